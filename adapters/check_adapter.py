"""A small step-protocol driver that checks adapters/mlx_lm_adapter.py on a real checkpoint,
before (and besides) parity's own client. Runs with plain python3 (no numpy) or the venv.

    python3 adapters/check_adapter.py --model ../shared/checkpoints/smollm2-135m-instruct-4bit \
        --dequantize [--prompts ../shared/reference/smollm2-4bit-f32-mlx-lm.json] [--steps 12]

It starts one adapter per path (`ci/mlx-lm adapters/mlx_lm_adapter.py --model DIR --cache ...`)
and drives hello/reset/create/forward/trim/release/share_prefix/stats/shutdown:

  (a) kv: prefill + greedy decode equals mlx-lm's own generate_step (greedy sampler), computed
      by this script's `reference` subcommand in the venv.
  (b) rotating equals kv bit for bit (window larger than the run), trims and share_prefix too.
  (c) batch and batch-model: two same-prompt rows, a ragged pair, a left-padded batched prefill
      (masked_prefix) and a per-row trim inside a batch, teacher-forced with kv's tokens;
      reported as exact or the largest difference (max |diff|, relative RMS).
  (d) on every path: trim then re-forward equals never having written the trimmed rows
      (rollback of draft rows; tile-padded prefill with the pads trimmed).
  Plus: share_prefix, stats (sequences, bytes, release), error replies, shutdown and EOF exits.
  quantized (8-bit KV) is measured against kv and reported (not expected to be exact).

Prompts: token ids from `--prompts` (a shared/reference JSON with `cases[].prompt_ids`), else
the bytes of a fixed text at lengths 37, 5 and 14 (the fixtures' tokenizers are byte-level).
Exit status 0 when every check passes.
"""

import argparse
import base64
import json
import math
import os
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEXT = b"One position counter per sequence; a trim either works or fails loudly. " * 2
PAD = 0
BATCH_PATHS = ("batch", "batch-model")  # the adapter's batched paths (masked prefixes, one call a forward)

# --- the protocol client ----------------------------------------------------------------------


class AdapterError(Exception):
    pass


class Adapter:
    """One adapter process; `call` sends a request and returns its reply."""

    def __init__(self, argv, label):
        self.label = label
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"check-adapter-{label}.log"), "w")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1
        )
        self.next_id = 0

    def send_line(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise AdapterError(f"{self.label}: adapter exited (status {self.proc.poll()}), see {self.log.name}")
        return json.loads(reply)

    def call(self, op, expect_ok=True, **fields):
        rid = self.next_id
        self.next_id += 1
        reply = self.send_line(json.dumps({"id": rid, "op": op, **fields}))
        if reply.get("id") != rid:
            raise AdapterError(f"{self.label}: reply id {reply.get('id')} for request {rid}")
        if expect_ok and not reply.get("ok"):
            raise AdapterError(f"{self.label}: {op} failed: {reply.get('error')}")
        return reply

    def forward(self, rows):
        """rows: [(seq, tokens, logits_at)] -> (lengths, [logits row as a list of floats])."""
        reply = self.call("forward", rows=[{"seq": s, "tokens": t, "logits_at": a} for s, t, a in rows])
        logits = reply["logits"]
        raw = base64.b64decode(logits["b64"])
        b, vocab = logits["shape"]
        if logits["dtype"] != "f32" or len(raw) != 4 * b * vocab or b != len(rows):
            raise AdapterError(f"{self.label}: bad logits {logits['dtype']} {logits['shape']} ({len(raw)} bytes)")
        values = struct.unpack(f"<{b * vocab}f", raw)
        return reply["lengths"], [list(values[i * vocab : (i + 1) * vocab]) for i in range(b)]

    def close(self, timeout=30):
        if self.proc.poll() is None:
            try:
                self.call("shutdown")
            except (AdapterError, OSError, ValueError):
                pass
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


# --- numbers ----------------------------------------------------------------------------------


def argmax(row):
    return max(range(len(row)), key=row.__getitem__)


class Diff:
    """The largest difference over a set of logits rows: exact, max |a-b|, relative RMS."""

    def __init__(self):
        self.exact = True
        self.max_abs = 0.0
        self.max_rel_rms = 0.0
        self.argmax_agree = 0
        self.rows = 0

    def add(self, got, want):
        self.rows += 1
        self.argmax_agree += argmax(got) == argmax(want)
        if got == want:
            return
        self.exact = False
        sq = sum((a - b) ** 2 for a, b in zip(got, want))
        ref = sum(b * b for b in want) or 1.0
        self.max_abs = max(self.max_abs, max(abs(a - b) for a, b in zip(got, want)))
        self.max_rel_rms = max(self.max_rel_rms, math.sqrt(sq / ref))

    def __str__(self):
        if self.exact:
            return f"bit-identical over {self.rows} logits rows"
        return (
            f"max |diff| {self.max_abs:.3e}, max rel RMS {self.max_rel_rms:.3e} over {self.rows} rows, "
            f"argmax agrees {self.argmax_agree}/{self.rows}"
        )


# --- scripts run on a path --------------------------------------------------------------------


def prefill(ad, prompt, masked=0):
    seq = ad.call("create", masked_prefix=masked)["seq"]
    lengths, logits = ad.forward([(seq, prompt, len(prompt) - 1)])
    assert lengths == [len(prompt)], (ad.label, lengths, len(prompt))
    return seq, logits[0]


def decode(ad, seq, feed):
    """Feed `feed` one token at a time; the logits after each."""
    out = []
    for tok in feed:
        lengths, logits = ad.forward([(seq, [tok], 0)])
        out.append(logits[0])
    return out


def clean_run(ad, prompt, steps, feed=None):
    """Prefill then decode: greedy (feed None) or teacher-forced with `feed`. Returns (tokens,
    logits rows): tokens[i] is the token fed at decode step i (greedy: steps + 1 argmaxes)."""
    ad.call("reset", faults=[])
    seq, first = prefill(ad, prompt)
    rows, tokens = [first], [argmax(first)]
    for i in range(steps):
        tok = feed[i] if feed else tokens[-1]
        (row,) = decode(ad, seq, [tok])
        rows.append(row)
        tokens.append(argmax(row))
    return (tokens if feed is None else feed[:steps]), rows


def batch_decode(ad, seqs, feeds, steps):
    """Decode the sequences together (one forward per step) with their own fed tokens."""
    rows = [[] for _ in seqs]
    for i in range(steps):
        lengths, logits = ad.forward([(s, [f[i]], 0) for s, f in zip(seqs, feeds)])
        for k, row in enumerate(logits):
            rows[k].append(row)
    return rows


def trim(ad, seq, n, length_before):
    reply = ad.call("trim", seq=seq, n=n)
    ok = reply["removed"] == n and reply["len"] == length_before - n
    return ok, reply


# --- the checks -------------------------------------------------------------------------------


class Report:
    def __init__(self):
        self.failed = 0

    def check(self, ok, what, detail=""):
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {what}{': ' + detail if detail else ''}", flush=True)

    def note(self, what, detail):
        print(f"info  {what}: {detail}", flush=True)


def check_hello(rep, ad, path):
    reply = ad.call("hello", protocol=1, model=ad.model, path=path, settings={})
    caps = reply["capabilities"]
    rep.check(
        reply["protocol"] == 1 and reply["engine"]["name"] == "mlx-lm" and caps["stats"] is True
        and caps["masked_prefix"] == (path in BATCH_PATHS) and caps["block_size"] is None,
        f"{path}: hello",
        f"engine {reply['engine']}, dtype {reply['dtype']}, vocab {reply['vocab_size']}, {caps}",
    )
    return reply


def check_generate_step(rep, args, kv, prompts, refs):
    cmd = [os.path.join(ROOT, "ci", "mlx-lm"), os.path.abspath(__file__), "reference", "--model", args.model,
           "--steps", str(args.steps), "--prompts-json", json.dumps(prompts)]
    if args.dequantize:
        cmd.append("--dequantize")
    want = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for i, prompt in enumerate(prompts):
        got = refs[i][0]
        rep.check(got == want[i], f"(a) kv greedy == mlx-lm generate_step, prompt {i} ({len(prompt)} tokens)",
                  f"{len(got)} tokens" if got == want[i] else f"adapter {got} vs generate_step {want[i]}")


def check_same_path_replay(rep, ad, label, prompts, refs, steps, expect_exact):
    """Every prompt teacher-forced with kv's tokens; compared with kv's logits."""
    diff = Diff()
    for i, prompt in enumerate(prompts):
        _, rows = clean_run(ad, prompt, steps, feed=refs[i][0][:steps])
        for got, want in zip(rows, refs[i][1]):
            diff.add(got, want)
    if expect_exact:
        rep.check(diff.exact, f"(b) {label} == kv bit for bit", str(diff))
    else:
        rep.note(f"{label} vs kv", str(diff))
    return diff


def check_rollback(rep, ad, label, prompt, ref, steps, lookahead=4):
    """Decode, write `lookahead` draft rows, trim them, continue: equal to the clean run."""
    tokens, clean = ref
    ad.call("reset", faults=[])
    seq, first = prefill(ad, prompt)
    rows = [first]
    length = len(prompt)
    ok_trims = True
    for i in range(steps):
        if i % 3 == 1:  # draft rows: one multi-token forward of wrong tokens, then trimmed
            draft = [(tokens[i] + 7 * (k + 1)) % 1000 + 3 for k in range(lookahead)]
            ad.forward([(seq, draft, lookahead - 1)])
            ok, reply = trim(ad, seq, lookahead, length + lookahead)
            ok_trims &= ok
            if not ok:
                rep.check(False, f"(d) {label} rollback trim", f"asked {lookahead}, got {reply}")
        (row,) = decode(ad, seq, [tokens[i]])
        length += 1
        rows.append(row)
    diff = Diff()
    for got, want in zip(rows, clean):
        diff.add(got, want)
    rep.check(ok_trims and diff.exact, f"(d) {label} rollback (draft {lookahead} rows, trim) == never written",
              str(diff))


def check_tile_padded(rep, ad, label, prompt, ref, steps, tile=32):
    """Prefill padded to a tile, logits at the last real token, pads trimmed, decode."""
    tokens, clean = ref
    ad.call("reset", faults=[])
    seq = ad.call("create", masked_prefix=0)["seq"]
    padded = prompt + [PAD] * (-len(prompt) % tile)
    lengths, (first,) = ad.forward([(seq, padded, len(prompt) - 1)])
    ok, reply = trim(ad, seq, len(padded) - len(prompt), len(padded))
    rows = [first] + decode(ad, seq, tokens[:steps])
    diff = Diff()
    for got, want in zip(rows, clean):
        diff.add(got, want)
    rep.check(ok, f"(d) {label} tile-padded prefill {len(prompt)} -> {len(padded)}, trim {len(padded) - len(prompt)}",
              f"trim reply {reply}")
    decode_diff = Diff()
    for got, want in zip(rows[1:], clean[1:]):
        decode_diff.add(got, want)
    what, detail = f"(d) {label} tile-padded then trimmed vs unpadded", f"{diff}; decode steps only: {decode_diff}"
    if decode_diff.exact:
        rep.check(True, what, detail)
    else:  # the prefill is a longer matmul: not bit-identical in general, reported
        rep.note(what, detail)


def check_share_prefix(rep, ad, label, prompt, ref, steps, rows_shared=None):
    """A copy of the donor's first rows, then the rest of the prompt and decode: compared with
    the clean run (the rest is a chunk of its own, so matmul shapes differ from the clean run)."""
    tokens, clean = ref
    rows_shared = rows_shared or len(prompt) * 2 // 3
    ad.call("reset", faults=[])
    donor, _ = prefill(ad, prompt)
    decode(ad, donor, tokens[:2])
    reply = ad.call("share_prefix", donor=donor, rows=rows_shared, expect_ok=False)
    if not reply["ok"]:
        rep.check(bool(reply.get("unsupported")), f"{label} share_prefix", f"reply {reply}")
        return None
    new = reply["seq"]
    lengths, (first,) = ad.forward([(new, prompt[rows_shared:], len(prompt) - rows_shared - 1)])
    rows = [first] + decode(ad, new, tokens[:steps])
    donor_rows = decode(ad, donor, tokens[2:steps])  # the donor keeps running, untouched
    stats = ad.call("stats")["stats"]
    diff, donor_diff = Diff(), Diff()
    for got, want in zip(rows, clean):
        diff.add(got, want)
    for got, want in zip(donor_rows, clean[3:]):
        donor_diff.add(got, want)
    rep.check(
        reply["mode"] == "copy" and lengths == [len(prompt)] and donor_diff.exact and stats["sequences"] == 2,
        f"{label} share_prefix {rows_shared}/{len(prompt) + 2} rows (mode {reply['mode']})",
        f"adopter vs clean: {diff}; donor after sharing: {donor_diff}",
    )
    return rows


def check_batch(rep, ad, prompts, refs, steps, label="batch"):
    long, short = prompts[0], prompts[1]
    ref_long, ref_short = refs[0], refs[1]

    # same prompt twice: prefilled separately, decoded in one batched forward
    ad.call("reset", faults=[])
    seqs = [prefill(ad, long)[0] for _ in range(2)]
    rows = batch_decode(ad, seqs, [ref_long[0][:steps]] * 2, steps)
    diff = Diff()
    for r in rows:
        for got, want in zip(r, ref_long[1][1:]):
            diff.add(got, want)
    rows_equal = rows[0] == rows[1]
    rep.check(diff.argmax_agree == diff.rows and rows_equal, f"(c) {label} same-prompt pair (B=2 decode) vs kv",
              f"{diff}; row 0 == row 1: {rows_equal}")

    # ragged pair: long next to short
    ad.call("reset", faults=[])
    a, _ = prefill(ad, long)
    b, _ = prefill(ad, short)
    rows = batch_decode(ad, [a, b], [ref_long[0][:steps], ref_short[0][:steps]], steps)
    diffs = [Diff(), Diff()]
    for k, ref in enumerate((ref_long, ref_short)):
        for got, want in zip(rows[k], ref[1][1:]):
            diffs[k].add(got, want)
    rep.check(all(d.argmax_agree == d.rows for d in diffs),
              f"(c) {label} ragged pair ({len(long)} + {len(short)}) vs kv", f"row 0: {diffs[0]}; row 1: {diffs[1]}")

    # left-padded batched prefill: the short prompt left-padded to the long one's length
    ad.call("reset", faults=[])
    pad = len(long) - len(short)
    a = ad.call("create", masked_prefix=0)["seq"]
    b = ad.call("create", masked_prefix=pad)["seq"]
    lengths, firsts = ad.forward([(a, long, len(long) - 1), (b, [PAD] * pad + short, len(long) - 1)])
    rows = batch_decode(ad, [a, b], [ref_long[0][:steps], ref_short[0][:steps]], steps)
    diffs = [Diff(), Diff()]
    for k, ref in enumerate((ref_long, ref_short)):
        for got, want in zip([firsts[k]] + rows[k], ref[1]):
            diffs[k].add(got, want)
    rep.check(lengths == [len(long), len(long)] and all(d.argmax_agree == d.rows for d in diffs),
              f"(c) {label} left-padded prefill (masked_prefix {pad}) + B=2 decode vs kv",
              f"lengths {lengths}; row 0: {diffs[0]}; row 1 (padded): {diffs[1]}")
    stats = ad.call("stats")["stats"]
    rep.check(stats["sequences"] == 2 and stats["bytes_in_use"] >= stats["bytes_live"] > 0,
              f"{label} stats after the left-padded pair", json.dumps(stats))

    # per-row trim inside a batch (extract route): both rows draft, each trimmed on its own
    ad.call("reset", faults=[])
    a, _ = prefill(ad, long)
    b, _ = prefill(ad, short)
    feeds = [ref_long[0][:steps], ref_short[0][:steps]]
    half = steps // 2
    rows = batch_decode(ad, [a, b], [f[:half] for f in feeds], half)
    ad.forward([(a, [5, 6, 7], 2), (b, [8, 9, 10], 2)])
    ok_a, ra = trim(ad, a, 3, len(long) + half + 3)
    ok_b, rb = trim(ad, b, 3, len(short) + half + 3)
    more = batch_decode(ad, [a, b], [f[half:] for f in feeds], steps - half)
    diffs = [Diff(), Diff()]
    for k, ref in enumerate((ref_long, ref_short)):
        for got, want in zip(rows[k] + more[k], ref[1][1:]):
            diffs[k].add(got, want)
    rep.check(ok_a and ok_b and all(d.argmax_agree == d.rows for d in diffs),
              f"(c)(d) {label}: draft rows in a B=2 forward, trimmed per row, B=2 decode again vs kv",
              f"trims {ra}, {rb}; row 0: {diffs[0]}; row 1: {diffs[1]}")


def check_continuous(rep, ad, prompts, refs, steps, arrivals=(0, 0, 2, 3, 6), max_batch=3, label="batch"):
    """Continuous batching: requests arrive at decode steps, are prefilled alone, join the
    batched decode while there is room, leave (release) when done: every composition change
    is an extract/filter/merge/extend in the batch path."""
    ad.call("reset", faults=[])
    waiting = [(k, k % len(prompts), at) for k, at in enumerate(arrivals)]
    active, done, rows = {}, 0, {k: [] for k, _, _ in waiting}
    t = 0
    while done < len(arrivals):
        for k, p, at in list(waiting):
            if at <= t and len(active) < max_batch:
                seq, first = prefill(ad, prompts[p])
                active[k] = (seq, p)
                rows[k].append(first)
                waiting.remove((k, p, at))
        if active:
            ks = list(active)
            feeds = [refs[active[k][1]][0][len(rows[k]) - 1] for k in ks]
            _, logits = ad.forward([(active[k][0], [f], 0) for k, f in zip(ks, feeds)])
            for k, row in zip(ks, logits):
                rows[k].append(row)
                if len(rows[k]) == steps + 1:
                    ad.call("release", seq=active.pop(k)[0])
                    done += 1
        t += 1
    diff = Diff()
    for k, p, _ in [(k, k % len(prompts), 0) for k in range(len(arrivals))]:
        for got, want in zip(rows[k], refs[p][1]):
            diff.add(got, want)
    stats = ad.call("stats")["stats"]
    rep.check(diff.argmax_agree == diff.rows and stats["sequences"] == 0 and stats["bytes_in_use"] == 0,
              f"(c) {label} continuous batching (arrivals {list(arrivals)}, max batch {max_batch}) vs kv",
              f"{diff}; after all released: {stats['sequences']} sequences, {stats['bytes_in_use']} B")


def check_errors_and_release(rep, ad, label, prompt):
    ad.call("reset", faults=[])
    seq, _ = prefill(ad, prompt)
    bad = [
        ad.call("trim", seq=99, n=1, expect_ok=False),
        ad.call("forward", rows=[{"seq": seq, "tokens": [], "logits_at": 0}], expect_ok=False),
        ad.call("forward", rows=[{"seq": seq, "tokens": [10**9], "logits_at": 0}], expect_ok=False),
        ad.call("trim", seq=seq, n=len(prompt) + 1, expect_ok=False) if label in BATCH_PATHS else None,
        ad.call("frobnicate", expect_ok=False),
    ]
    raw = ad.send_line("this is not json")
    bad = [r for r in bad if r is not None]
    masked = ad.call("create", masked_prefix=3, expect_ok=False)
    errors_ok = all(not r["ok"] and r["error"] for r in bad) and not raw["ok"]
    masked_ok = masked["ok"] if label in BATCH_PATHS else (masked.get("unsupported") is True)
    if masked["ok"]:
        ad.call("release", seq=masked["seq"])
    stats = ad.call("stats")["stats"]
    ad.call("release", seq=seq)
    after = ad.call("stats")["stats"]
    rep.check(errors_ok and masked_ok and stats["sequences"] == 1 and after["sequences"] == 0
              and after["bytes_in_use"] == 0 and after["peak_bytes_in_use"] >= stats["bytes_in_use"] > 0,
              f"{label}: bad requests answered ok:false and serving goes on; release frees",
              f"errors: {[r['error'] for r in bad][:2]}...; masked create: {masked.get('error', 'ok')}; "
              f"stats {stats['bytes_live']}/{stats['bytes_in_use']} B -> {after['bytes_in_use']} B")


def check_exits(rep, argv):
    ad = Adapter(argv, "exit-eof")
    ad.proc.stdin.close()
    try:
        code = ad.proc.wait(120)
    except subprocess.TimeoutExpired:
        ad.proc.kill()
        code = "timeout"
    ad.log.close()
    rep.check(code == 0, "stdin EOF: the adapter exits cleanly", f"exit status {code}")


# --- the reference subcommand (runs in the venv) ----------------------------------------------


def reference(argv):
    """mlx-lm's generate_step with the greedy sampler, model loaded as the adapter loads it."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dequantize", action="store_true")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts-json", required=True)
    a = p.parse_args(argv)
    sys.path.insert(0, HERE)
    import mlx.core as mx

    import mlx_lm_adapter as adapter

    adapter.pick_device(mx)
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _, _ = adapter.load_model(mx, a.model, "float32", a.dequantize)
    out = []
    for prompt in json.loads(a.prompts_json):
        gen = generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=a.steps + 1,
                            sampler=make_sampler(temp=0.0))
        out.append([tok for tok, _ in gen])
    print(json.dumps(out))


# --- main -------------------------------------------------------------------------------------


def load_prompts(path):
    if path:
        with open(path) as f:
            return [c["prompt_ids"] for c in json.load(f)["cases"]][:3]
    return [list(TEXT[:n]) for n in (37, 5, 14)]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "reference":
        return reference(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dequantize", action="store_true")
    p.add_argument("--prompts", help="reference JSON whose cases[].prompt_ids are the prompts")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-size", type=int, default=4096, help="RotatingKVCache window")
    p.add_argument("--group-size", type=int, default=64, help="QuantizedKVCache group size")
    p.add_argument("--paths", default="kv,rotating,quantized,batch")
    args = p.parse_args()
    args.model = os.path.abspath(args.model)
    prompts = sorted(load_prompts(args.prompts), key=len, reverse=True)  # long first
    base = [os.path.join(ROOT, "ci", "mlx-lm"), os.path.join(HERE, "mlx_lm_adapter.py"), "--model", args.model]
    if args.dequantize:
        base.append("--dequantize")
    extra = {"kv": [], "batch": [], "batch-model": [], "quantized": ["--group-size", str(args.group_size)], "rotating": ["--max-size", str(args.max_size)]}
    paths = args.paths.split(",")
    rep = Report()
    t0 = time.time()
    adapters = {}
    try:
        for path in ["kv"] + [q for q in paths if q != "kv"]:
            adapters[path] = Adapter(base + ["--cache", path] + extra[path], path)
            adapters[path].model = args.model
        for path, ad in list(adapters.items()):
            check_hello(rep, ad, path)
            probe = ad.call("create", masked_prefix=0, expect_ok=False)
            if not probe["ok"]:
                rep.check(bool(probe.get("unsupported")), f"{path}: skipped (unsupported)", probe["error"])
                del adapters[path]
                rep.check(ad.close() == 0, f"{path}: shutdown")
        kv = adapters["kv"]
        refs = [clean_run(kv, prompt, args.steps) for prompt in prompts]
        print(f"      prompts {[len(x) for x in prompts]}, kv greedy {[r[0][:6] for r in refs]}...", flush=True)
        check_generate_step(rep, args, kv, prompts, refs)
        for path, ad in adapters.items():
            if path != "kv":
                check_same_path_replay(rep, ad, path, prompts, refs, args.steps, expect_exact=path == "rotating")
            if path in BATCH_PATHS:
                check_batch(rep, ad, prompts, refs, args.steps, label=path)
                check_continuous(rep, ad, prompts, refs, args.steps, label=path)
            own = refs[0] if path in ("kv", "rotating") else clean_run(ad, prompts[0], args.steps, refs[0][0])
            check_rollback(rep, ad, path, prompts[0], own, args.steps)
            check_tile_padded(rep, ad, path, prompts[0], own, args.steps)
            check_share_prefix(rep, ad, path, prompts[0], own, args.steps)
            check_errors_and_release(rep, ad, path, prompts[0])
    finally:
        for path, ad in adapters.items():
            code = ad.close()
            if rep is not None:
                rep.check(code == 0, f"{path}: shutdown", f"exit status {code}")
    check_exits(rep, base + ["--cache", "kv"])
    print(f"{'all checks passed' if not rep.failed else f'{rep.failed} check(s) FAILED'} "
          f"({time.time() - t0:.0f} s)")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
