"""A toy engine on the adapter kit (parity_adapter.py): the smallest complete adapter, and the
one the kit's end-to-end test runs under parity (suites/kit.toml, tests/adapter_kit.rs).

    python3 adapters/toy_adapter.py --path alone|batched|racy

Its "model" is a pure function of a sequence's tokens so far (a seeded hash of the history:
the same logits for the same history, however it was fed), and its "KV cache" is that
history, 8 bytes a row. `alone` runs a forward's rows one model call each; `batched` runs
them in one. Both honour trims, releases and prefix copies and keep the protocol's counters,
so every claim parity makes of a case can be shown, or (alone's batching) is not.

`racy` is `batched` with a nondeterminism planted: each call scales its logits by a factor a
millionth away from 1 for every call the process made before it, as a kernel whose rounding
depends on what earlier calls left in a shared workspace. The greedy tokens never change and
the logits stay within any tolerance of the reference; only running one schedule twice
(parity's `repeat`) shows it. Standard library only.
"""

import argparse
import json
import os
import random

from parity_adapter import Engine, RequestError, capabilities, counters, serve

ROW_BYTES = 8


class Toy(Engine):
    name = "toy"
    version = "1"

    def __init__(self, path):
        self.path = path
        self.vocab = None
        # Calls since the process started: kept across sessions (reset), which is the bug.
        self.calls_ever = 0
        self.reset()

    def load(self, model, path, settings):
        config = os.path.join(model or "", "config.json")
        try:
            with open(config) as f:
                self.vocab = int(json.load(f)["vocab_size"])
        except (OSError, ValueError, KeyError) as e:
            raise RequestError(f"{config}: no vocab_size ({e})") from e

    def describe(self):
        caps = capabilities(share_prefix=True, stats=True, kv_row_bytes=ROW_BYTES)
        return {"vocab_size": self.vocab, "dtype": "float32", "capabilities": caps}

    def reset(self):
        self.seqs, self.next_id, self.peak = {}, 0, 0
        self.counts = dict(forwards=0, max_rows=0, tokens=0, rows_trimmed=0, rows_copied=0)

    def logits(self, history):
        seed = 1469598103934665603
        for t in history[-64:]:
            seed = ((seed ^ t) * 1099511628211) % (1 << 64)
        rng = random.Random(seed ^ len(history))
        return [rng.gauss(0.0, 3.0) for _ in range(self.vocab)]

    def call(self, rows):
        """One model call over `rows`: append the tokens, read the logits at logits_at."""
        self.counts["forwards"] += 1
        self.counts["max_rows"] = max(self.counts["max_rows"], len(rows))
        out = []
        for row in rows:
            history = self.seqs[row.seq]
            before = len(history)
            history.extend(row.tokens)
            self.counts["tokens"] += len(row.tokens)
            out.append(self.logits(history[: before + row.logits_at + 1]))
        self.peak = max(self.peak, self.rows())
        return out

    def create(self, masked_prefix):
        seq = self.next_id
        self.next_id += 1
        self.seqs[seq] = []
        return seq

    def forward(self, rows):
        if self.path == "racy":
            scale = 1.0 + 1e-6 * self.calls_ever
            self.calls_ever += 1
            logits = [[x * scale for x in row] for row in self.call(rows)]
        elif self.path == "batched":
            logits = self.call(rows)
        else:
            logits = [l for row in rows for l in self.call([row])]
        return logits, [len(self.seqs[row.seq]) for row in rows]

    def trim(self, seq, n):
        history = self.seqs[seq]
        removed = min(n, len(history))
        del history[len(history) - removed :]
        self.counts["rows_trimmed"] += removed
        return removed, len(history)

    def release(self, seq):
        del self.seqs[seq]

    def share_prefix(self, donor, rows):
        history = self.seqs[donor]
        if rows > len(history):
            raise RequestError(f"sequence {donor} has {len(history)} rows, cannot share {rows}")
        seq = self.create(0)
        self.seqs[seq] = history[:rows]
        self.counts["rows_copied"] += rows
        self.peak = max(self.peak, self.rows())
        return seq, "copy"

    def rows(self):
        return sum(len(h) for h in self.seqs.values())

    def stats(self):
        live = self.rows() * ROW_BYTES
        return {
            "bytes_live": live,
            "bytes_in_use": live,
            "bytes_reserved": live,
            "peak_bytes_in_use": self.peak * ROW_BYTES,
            "counters": counters(**self.counts),
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=("alone", "batched", "racy"), required=True)
    serve(Toy(p.parse_args().path))


if __name__ == "__main__":
    main()
