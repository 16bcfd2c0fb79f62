#!/usr/bin/env python3
"""A misbehaving adapter for parity's failure-mode tests: it runs a real adapter (the command
after `--`) and relays the step protocol, breaking it in one chosen way.

    misbehave.py MODE [N [TAG]] -- parity adapter CHECKPOINT --path paged

TAG is ignored: tests put a unique word there to find leftover processes.
MODE (N counts `forward` requests, 1-based; default 3):
  pass            relay faithfully (the healthy control)
  exit-at-start   print a reason to stderr and exit 3 before reading anything
  crash           on the Nth forward, print to stderr and kill itself (SIGKILL)
  garbage         answer the Nth forward with a line that is not JSON
  hang            never answer the Nth forward (parity's timeout must fire)
  wrong-logits    answer the Nth forward with logits of the wrong shape
  nan-logits      answer the Nth forward with its first logit NaN (the rest faithful)
  deaf            close stdin and sleep without ever answering: nothing but a signal ends it
                  (the test that parity's children die with a parity killed by SIGKILL)
  fake-trim       claim every trim succeeded without passing it on; lengths in later
                  replies are rewritten to match the claim, so only the logits can tell

Plants for the evidence checks (the tokens stay right; only the engine's own account of what
it did can tell, which is what parity reads):
  row-by-row      run a forward of B rows as B forwards of one row and join the logits, as an
                  engine that claims batching but loops over rows does
  refuse-share    answer every share_prefix with no sequence (parity must recompute)
  recompute-share answer share_prefix "copy" but build the new sequence by running the
                  donor's tokens through the model again
  wide-kv         declare half the KV bytes per row the inner adapter stores (hello's
                  kv_row_bytes): a layout stored at twice the bytes it promises
"""

import base64

import json
import os
import signal
import struct
import subprocess
import sys
import time


def main():
    argv = sys.argv[1:]
    sep = argv.index("--")
    mode, rest, inner = argv[0], argv[1:sep], argv[sep + 1:]
    n = int(rest[0]) if rest else 3
    if mode == "deaf":
        sys.stdin.close()
        os.close(0)
        while True:
            time.sleep(60)
    if mode == "exit-at-start":
        print("misbehave: refusing to start (exit-at-start)", file=sys.stderr, flush=True)
        sys.exit(3)
    child = subprocess.Popen(inner, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    own_ids = iter(range(10**12, 2 * 10**12))

    def ask(request):
        """One request of the relay's own to the inner adapter; its reply."""
        request = dict(request, id=next(own_ids))
        child.stdin.write(json.dumps(request) + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    fed = {}  # seq -> tokens the sequence holds (recompute-share)
    forwards = 0
    untrimmed = {}  # seq -> rows the real adapter still holds beyond what was claimed
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "forward":
            forwards += 1
        if mode == "row-by-row" and op == "forward" and len(req["rows"]) > 1:
            parts = [ask({"op": "forward", "rows": [row]}) for row in req["rows"]]
            bad = next((p for p in parts if not p.get("ok")), None)
            if bad is not None:
                reply(req["id"], {"ok": False, "error": bad.get("error", "?")})
                continue
            logits = b"".join(base64.b64decode(p["logits"]["b64"]) for p in parts)
            vocab = parts[0]["logits"]["shape"][1]
            reply(req["id"], {
                "lengths": [p["lengths"][0] for p in parts],
                "logits": {"dtype": "f32", "shape": [len(parts), vocab], "b64": base64.b64encode(logits).decode()},
            })
            continue
        if mode == "refuse-share" and op == "share_prefix":
            reply(req["id"], {"seq": None})
            continue
        if mode == "recompute-share" and op == "share_prefix":
            tokens = fed.get(req["donor"], [])[: req["rows"]]
            made = ask({"op": "create", "masked_prefix": 0})
            if tokens:
                ask({"op": "forward", "rows": [{"seq": made["seq"], "tokens": tokens, "logits_at": len(tokens) - 1}]})
            fed[made["seq"]] = list(tokens)
            reply(req["id"], {"seq": made["seq"], "mode": "copy"})
            continue
        if mode == "fake-trim" and op == "trim":
            seq, k = req["seq"], req["n"]
            untrimmed[seq] = untrimmed.get(seq, 0) + k
            claimed = lengths.get(seq, 0) - k
            lengths[seq] = claimed
            reply(req["id"], {"removed": k, "len": claimed})
            continue
        child.stdin.write(line if line.endswith("\n") else line + "\n")
        child.stdin.flush()
        answer = child.stdout.readline()
        if not answer:
            print("misbehave: the inner adapter died", file=sys.stderr, flush=True)
            sys.exit(4)
        if op == "forward" and forwards == n:
            if mode == "crash":
                print(f"misbehave: crashing on forward {n}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "garbage":
                print("this is not a protocol line", flush=True)
                continue
            if mode == "hang":
                print(f"misbehave: hanging on forward {n}", file=sys.stderr, flush=True)
                while True:
                    time.sleep(60)
            if mode == "wrong-logits":
                msg = json.loads(answer)
                msg["logits"]["shape"][1] -= 1
                print(json.dumps(msg), flush=True)
                continue
            if mode == "nan-logits":
                msg = json.loads(answer)
                raw = bytearray(base64.b64decode(msg["logits"]["b64"]))
                raw[0:4] = struct.pack("<f", float("nan"))
                msg["logits"]["b64"] = base64.b64encode(bytes(raw)).decode()
                print(json.dumps(msg), flush=True)
                continue
        if mode == "recompute-share":
            msg = json.loads(answer)
            if op == "reset":
                fed.clear()  # a fresh store numbers its sequences from 0 again
            if op == "forward" and msg.get("ok"):
                for row in req["rows"]:
                    fed.setdefault(row["seq"], []).extend(row["tokens"])
            if op == "trim" and msg.get("ok"):
                held = fed.get(req["seq"], [])
                fed[req["seq"]] = held[: len(held) - msg["removed"]]
        if mode == "wide-kv" and op == "hello":
            msg = json.loads(answer)
            caps = msg.get("capabilities", {})
            if caps.get("kv_row_bytes"):
                caps["kv_row_bytes"] //= 2
            answer = json.dumps(msg) + "\n"
        if mode == "fake-trim":
            msg = json.loads(answer)
            if op == "create" and msg.get("ok"):
                lengths[msg["seq"]] = 0
            if op == "share_prefix" and msg.get("ok") and msg.get("seq") is not None:
                lengths[msg["seq"]] = req["rows"]
            if op == "forward" and msg.get("ok"):
                fixed = []
                for row, real in zip(req["rows"], msg["lengths"]):
                    claimed = real - untrimmed.get(row["seq"], 0)
                    lengths[row["seq"]] = claimed
                    fixed.append(claimed)
                msg["lengths"] = fixed
            answer = json.dumps(msg) + "\n"
        sys.stdout.write(answer)
        sys.stdout.flush()


def reply(rid, fields):
    fields = {"ok": True, **fields, "id": rid}
    print(json.dumps(fields), flush=True)


lengths = {}

if __name__ == "__main__":
    main()
