#!/usr/bin/env python3
"""A small OpenAI-compatible completions server for parity's tests (stdlib only).

It "generates" from a deterministic function of the token history over the fixture
tokenizer's byte vocabulary (ids 0-255 are bytes; only printable ASCII is ever chosen, so text
and tokens round-trip), returns top-k logprobs the way mlx_lm.server 0.32.2 does (unsorted, the
first entry presented as the chosen token), and misbehaves on request:

  --mode ok | exit-at-start | never-ready | die-after N | http500 | malformed | no-logprobs
         | perturb X (add X to every logprob) | flip-at K (pick the runner-up at step K)
         | noise S (Gaussian noise of standard deviation S on every logit, renormalised: a
           lossy path, whose distributions move while staying distributions)
         | batch-flip (pick the runner-up at step 1 whenever two requests are in flight)
         | covered-crash (drop the connection, unanswered, when the prompt cache holds the whole
           prompt: mlx_lm.server 0.32.2's bug)
         | serialize (answer one request at a time, in arrival order: "concurrent" requests
           served one after the other)
         | cache-never-hits (report 0 cached prompt tokens always: a prompt cache that misses)
  GET /metrics  Prometheus text: fake_requests_total and fake_tokens_generated_total count,
                fake_paged_launches_total never moves (a kernel this server never takes)
  --stream-logprobs     streamed chunks carry logprobs (llama-server style)
  --count-off N         report usage.prompt_tokens off by N (a tokenizer that disagrees)
  --token-delay S       seconds per generated token (lets concurrent requests overlap)
  --tag T               ignored; lets a test find its own servers in the process table
"""
import argparse
import json
import math
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--mode", default="ok")
p.add_argument("--arg", default=None)
p.add_argument("--stream-logprobs", action="store_true")
p.add_argument("--count-off", type=int, default=0)
p.add_argument("--token-delay", type=float, default=0.005)
p.add_argument("--tag", default="")
args = p.parse_args()

if args.mode == "exit-at-start":
    print("error: unrecognized arguments: --bogus-flag", file=sys.stderr, flush=True)
    sys.exit(2)

VOCAB = 256
PRINTABLE = range(32, 127)
lock = threading.Lock()
turns = threading.Condition()  # --mode serialize: one generation at a time, in arrival order
queue = {"next": 0, "serving": 0}
state = {"requests": 0, "in_flight": 0, "generated": 0}
history_cache = []  # every prompt + output served, for cached_tokens


def logprobs(history):
    """Log-softmax over the byte vocabulary for this history; non-printable bytes unlikely."""
    seed = 1469598103934665603
    for t in history[-64:]:
        seed = ((seed ^ t) * 1099511628211) % (1 << 64)
    rng = random.Random(seed ^ len(history))
    logits = [rng.gauss(0.0, 3.0) if i in PRINTABLE else -40.0 for i in range(VOCAB)]
    m = max(logits)
    lse = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - lse for x in logits]


def generate(ids, max_tokens, k, ticket=None):
    if ticket is not None:
        with turns:
            turns.wait_for(lambda: queue["serving"] == ticket)
    with lock:
        state["in_flight"] += 1
    try:
        history, steps = list(ids), []
        for step in range(max_tokens):
            lp = logprobs(history)
            if args.mode == "perturb":
                lp = [x + float(args.arg) for x in lp]
            if args.mode == "noise":
                rng = random.Random(len(history) * 7919 + sum(history[-8:]))
                noisy = [x + rng.gauss(0.0, float(args.arg)) for x in lp]
                m = max(noisy)
                lse = m + math.log(sum(math.exp(x - m) for x in noisy))
                lp = [x - lse for x in noisy]
            order = sorted(range(VOCAB), key=lambda i: (-lp[i], i))
            chosen = order[0]
            with lock:
                batched = state["in_flight"] > 1
            if (args.mode == "flip-at" and step == int(args.arg)) or (args.mode == "batch-flip" and batched and step == 1):
                chosen = order[1]
                lp[order[0]], lp[order[1]] = lp[order[1]], lp[order[0]]
                order[0], order[1] = order[1], order[0]
            top = [{"id": i, "token": chr(i) if i != 32 else "\u0120", "logprob": lp[i]} for i in order[:k]]
            random.Random(step).shuffle(top)  # unsorted, as mlx_lm.server returns them
            steps.append((chosen, top))
            history.append(chosen)
            time.sleep(args.token_delay)
            with lock:
                state["generated"] += 1
            yield chosen, top
    finally:
        with lock:
            state["in_flight"] -= 1
        if ticket is not None:
            with turns:
                queue["serving"] += 1
                turns.notify_all()


def cached(ids):
    if args.mode == "cache-never-hits":
        return 0
    best = 0
    with lock:
        for h in history_cache:
            n = 0
            while n < min(len(h), len(ids)) and h[n] == ids[n]:
                n += 1
            best = max(best, n)
    return best


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *a):
        print("fake_openai: " + fmt % a, file=sys.stderr, flush=True)

    def send(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            if args.mode == "never-ready":
                return self.send(503, json.dumps({"status": "loading"}))
            return self.send(200, json.dumps({"status": "ok"}))
        if self.path == "/metrics":
            with lock:
                text = (
                    "# TYPE fake_requests_total counter\n"
                    f"fake_requests_total {state['requests']}\n"
                    f'fake_tokens_generated_total{{slot="0"}} {state["generated"]}\n'
                    "fake_paged_launches_total 0\n"
                )
            return self.send(200, text, "text/plain; version=0.0.4")
        self.send(404, "not found", "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with lock:
            state["requests"] += 1
            n = state["requests"]
        if args.mode == "die-after" and n > int(args.arg):
            print(f"fake_openai: dying at request {n}", file=sys.stderr, flush=True)
            os._exit(3)
        if args.mode == "http500":
            return self.send(500, json.dumps({"error": "boom"}))
        if args.mode == "malformed":
            return self.send(200, '{"choices": [ {"text": "unterminated')
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else list(prompt.encode("utf-8"))
        k = int(body.get("top_logprobs", 5))
        ticket = None
        if args.mode == "serialize":
            with turns:
                ticket = queue["next"]
                queue["next"] += 1
        if args.mode == "covered-crash" and cached(ids) >= len(ids):
            print("fake_openai: ValueError: the cache holds the whole prompt", file=sys.stderr, flush=True)
            self.close_connection = True
            return
        usage = {"prompt_tokens": len(ids) + args.count_off, "completion_tokens": 0,
                 "prompt_tokens_details": {"cached_tokens": cached(ids)}}
        out = []
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b": keepalive 1/1\n\n")
            for tok, top in generate(ids, body["max_tokens"], k, ticket):
                out.append(tok)
                choice = {"index": 0, "text": chr(tok), "finish_reason": None}
                if args.stream_logprobs and args.mode != "no-logprobs":
                    choice["logprobs"] = {"content": [dict(top[0], top_logprobs=top)]}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
            usage["completion_tokens"] = len(out)
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True
        else:
            content = []
            for tok, top in generate(ids, body["max_tokens"], k, ticket):
                out.append(tok)
                content.append(dict(top[0], top_logprobs=top))
            usage["completion_tokens"] = len(out)
            choice = {"index": 0, "text": "".join(chr(t) for t in out), "finish_reason": "length"}
            if args.mode != "no-logprobs":
                choice["logprobs"] = {"content": content}
            self.send(200, json.dumps({"system_fingerprint": "fake-1", "choices": [choice], "usage": usage}))
        with lock:
            history_cache.append(ids + out)


ThreadingHTTPServer.daemon_threads = True
server = ThreadingHTTPServer((args.host, args.port), Handler)
print(f"fake_openai: listening on {args.host}:{args.port} mode={args.mode}", file=sys.stderr, flush=True)
server.serve_forever()
