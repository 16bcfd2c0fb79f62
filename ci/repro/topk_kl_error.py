"""How much of the KL between a quantized K/V cache and its f16 reference a server's top-k
logprobs can see: the same llama.cpp forwards, KL computed over the whole vocabulary and as
parity computes it from a server's answer (compare::topk_position_samples: the reference's
top-k tokens plus one bucket for the rest of the vocabulary).

    ci/llama-cpp ci/repro/topk_kl_error.py [GGUF] [POSITIONS] [K]
    (default: SmolLM2-135M-Instruct Q4_1, 1024 positions of corpus/moby-dick-1-3.txt, k = 20)

llama-cpp-python 0.3.36's vendored llama.cpp, one context per cache type (f16, q8_0 K, q4_0 K;
flash attention on, one thread), the text tokenized by llama.cpp's own tokenizer and read
teacher-forced one token per llama_decode, as suites/lossy.toml's corpus rows read it. Prints,
per type, the mean and p99 of both KLs and their ratio: the top-k KL is a lower bound of the
full one where the path's list holds the reference's top-k (the log-sum inequality), and this
says by how much it falls short on a real model. Measured (2026-12-01, 2 shared cores, 2.5 min):

    SmolLM2-135M-Instruct.Q4_1.gguf, 1024 positions, k = 20
    K q8_0: full KL mean 4.287e-03 p99 1.612e-02; top-20 KL mean 2.784e-03 p99 1.328e-02; ratio of means 0.649; top-20 over full at 0 positions; path's list holds the reference's at 409 of 1024
    K q4_0: full KL mean 3.871e-02 p99 2.367e-01; top-20 KL mean 2.482e-02 p99 1.786e-01; ratio of means 0.641; top-20 over full at 0 positions; path's list holds the reference's at 77 of 1024

The top-20 means are llama-server's q8-k and q4-k rows of suites/lossy.toml to the digits
shown (2.78e-3, 2.48e-2): the server computes what the C API does.
"""

import ctypes
import os
import sys

import numpy as np

import llama_cpp as L

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
GGUF = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".deps/smollm2-gguf-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf")
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
K = int(sys.argv[3]) if len(sys.argv) > 3 else 20
TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}

QUIET = L.llama_log_callback(lambda level, text, user: None)  # kept: ctypes frees a collected callback
L.llama_log_set(QUIET, None)
L.llama_backend_init()
model = L.llama_model_load_from_file(GGUF.encode(), L.llama_model_default_params())
if not model:
    sys.exit(f"{GGUF}: llama.cpp could not load it")
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)

text = open(os.path.join(ROOT, "corpus/moby-dick-1-3.txt"), "rb").read()
buf = (L.llama_token * (len(text) + 16))()
n = L.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False)
if n < N + 1:
    sys.exit(f"the corpus is {n} tokens, fewer than {N + 1}")
tokens = list(buf[: N + 1])


def context(type_k):
    p = L.llama_context_default_params()
    p.n_ctx = p.n_batch = p.n_ubatch = 2048
    p.flash_attn_type = 1
    p.type_k = TYPES[type_k]
    p.n_threads = p.n_threads_batch = 1
    ctx = L.llama_init_from_model(model, p)
    if not ctx:
        sys.exit(f"llama_init_from_model refused K {type_k}")
    return ctx


def read(ctx):
    """Log-softmax of the logits after each of the first N tokens, one llama_decode each."""
    out = np.empty((N, n_vocab), dtype=np.float64)
    batch = L.llama_batch_init(1, 0, 1)
    for i in range(N):
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = tokens[i], i, 1, True
        batch.seq_id[0][0] = 0
        if L.llama_decode(ctx, batch) != 0:
            sys.exit(f"llama_decode failed at position {i}")
        x = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, 0), shape=(n_vocab,)).astype(np.float64)
        m = x.max()
        out[i] = x - (m + np.log(np.exp(x - m).sum()))
    L.llama_batch_free(batch)
    return out


def topk_kl(lr, la):
    """parity's compare::topk_position_samples on the two rows' top-K lists."""
    r = np.argsort(-lr)[:K]
    a = np.argsort(-la)[:K]
    a_last = la[a[-1]]
    listed = set(a.tolist())
    kl = r_mass = a_mass = 0.0
    for t in r:
        pa = la[t] if t in listed else a_last
        pr = np.exp(lr[t])
        kl += pr * (lr[t] - pa)
        r_mass += pr
        a_mass += np.exp(pa)
    r_rest, a_rest = max(0.0, 1.0 - r_mass), max(1.0 - a_mass, np.finfo(float).tiny)
    if r_rest > 0:
        kl += r_rest * np.log(r_rest / a_rest)
    return max(kl, 0.0), listed.issuperset(r.tolist())


reference = read(context("f16"))
print(f"{os.path.basename(GGUF)}, {N} positions, k = {K}")
for kind in ("q8_0", "q4_0"):
    path = read(context(kind))
    full = np.maximum((np.exp(reference) * (reference - path)).sum(axis=1), 0.0)
    seen = [topk_kl(reference[i], path[i]) for i in range(N)]
    top = np.array([s[0] for s in seen])
    held = sum(s[1] for s in seen)
    print(
        f"K {kind}: full KL mean {full.mean():.3e} p99 {np.percentile(full, 99):.3e}; "
        f"top-{K} KL mean {top.mean():.3e} p99 {np.percentile(top, 99):.3e}; "
        f"ratio of means {top.mean() / full.mean():.3f}; "
        f"top-{K} over full at {(top > full + 1e-9).sum()} positions; "
        f"path's list holds the reference's at {held} of {N}"
    )
