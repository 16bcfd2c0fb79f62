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
  fake-trim       claim every trim succeeded without passing it on; lengths in later
                  replies are rewritten to match the claim, so only the logits can tell
"""

import json
import os
import signal
import subprocess
import sys
import time


def main():
    argv = sys.argv[1:]
    sep = argv.index("--")
    mode, rest, inner = argv[0], argv[1:sep], argv[sep + 1:]
    n = int(rest[0]) if rest else 3
    if mode == "exit-at-start":
        print("misbehave: refusing to start (exit-at-start)", file=sys.stderr, flush=True)
        sys.exit(3)
    child = subprocess.Popen(inner, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    forwards = 0
    untrimmed = {}  # seq -> rows the real adapter still holds beyond what was claimed
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "forward":
            forwards += 1
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
    fields.update({"id": rid, "ok": True})
    print(json.dumps(fields), flush=True)


lengths = {}

if __name__ == "__main__":
    main()
