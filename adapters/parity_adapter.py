"""The adapter kit: what every parity step-protocol adapter written in Python shares, so an
adapter is only its engine's calls. The protocol is docs/step-protocol.md; this module is its
loop, its checks and its encodings.

    from parity_adapter import Engine, RequestError, Unsupported, serve

    class MyEngine(Engine):
        def load(self, model, path, settings): ...          # hello: load the checkpoint
        def describe(self): ...                              # vocab_size, dtype, capabilities
        def reset(self): ...
        def create(self, masked_prefix): return seq_id
        def forward(self, rows): return logits, lengths      # logits [B, vocab]: numpy, MLX or lists
        def trim(self, seq, n): return removed, length
        def release(self, seq): ...
        def share_prefix(self, donor, rows): return seq_id, "share" | "copy"   (or None)
        def stats(self): return {...}                        # optional: KV bytes, counters

    if __name__ == "__main__":
        serve(MyEngine())

The kit reads one JSON request per line on stdin and writes one reply per line on a private
copy of stdout; file descriptor 1 is pointed at stderr first, so library output (Python's or C's)
cannot corrupt the protocol. Before a request reaches the engine the kit checks what the
protocol promises and an engine would otherwise check by hand: the ids of live sequences (it
keeps them from create, share_prefix and release), forward rows (non-empty, one width,
distinct sequences, token ids within vocab_size, logits_at within the tokens), trim counts
and masked prefixes. After the engine answers it checks the reply's shape (a logits row per
sequence of vocab_size, a length per row, a removed count no larger than asked) and encodes
the logits exactly (float32, little-endian, base64).

An engine raises `Unsupported` for what its path cannot do (a named skip in parity's report)
and `RequestError` for a bad request; any other exception is reported as the request's error
with its traceback on stderr, and the adapter keeps serving. `python3 adapters/test_parity_adapter.py`
tests the kit; running a suite on the adapter (see docs/step-protocol.md) tests the engine.
"""

import base64
import json
import os
import struct
import sys
import traceback

PROTOCOL = 1

OPS = ("hello", "reset", "create", "forward", "trim", "release", "share_prefix", "stats", "shutdown")

COUNTERS = (
    "forwards",
    "max_rows",
    "tokens",
    "reads_crossing_blocks",
    "reads_non_adjacent",
    "cow_copies",
    "rows_trimmed",
    "blocks_freed",
    "window_blocks_released",
    "rows_shared",
    "rows_copied",
)


class RequestError(Exception):
    """A bad or failed request: `ok: false` with this sentence; the adapter keeps serving."""


class Unsupported(Exception):
    """An operation this path cannot do: a named skip in parity's report, not a failure."""


class Engine:
    """One path of an engine. Override what the path does; the defaults say it cannot."""

    #: Recorded in every report.
    name = "engine"
    version = "0"
    #: Where the path computes ("cpu", "gpu"), or None to leave it unsaid. Recorded beside
    #: parity's own device, so a report comparing across devices names both sides; a
    #: reference pinned to a device (`builtin:dense@cpu`) refuses an adapter that names another.
    device = None

    def load(self, model, path, settings):
        """hello: load `model` (the checkpoint directory, or the suite's engine.model) for
        the path named `path`; `settings` are the suite's scenario settings."""

    def describe(self):
        """hello's reply: {"vocab_size": int, "dtype": "float32" | "bfloat16" | "float16",
        "capabilities": capabilities(...)}."""
        raise NotImplementedError("describe(): vocab_size, dtype and capabilities")

    def reset(self):
        """Drop every sequence; start a fresh KV store, peak statistics and counters."""

    def create(self, masked_prefix):
        raise Unsupported(f"{self.name} cannot create sequences")

    def forward(self, rows):
        """Append each row's tokens to its sequence in one step; return (logits, lengths):
        one logits row per `rows` entry (at its logits_at) and each sequence's new length."""
        raise Unsupported(f"{self.name} cannot run a forward")

    def trim(self, seq, n):
        """Drop the newest n rows; return (removed, length) as they are, not as asked."""
        raise Unsupported(f"{self.name} cannot trim")

    def release(self, seq):
        """The sequence is finished; its storage goes back to the engine."""

    def share_prefix(self, donor, rows):
        """A new sequence whose first `rows` rows are the donor's: (seq, "share" | "copy"), or
        None where the path cannot reuse rows (parity then recomputes them)."""
        raise Unsupported(f"{self.name} cannot share a prefix")

    def stats(self):
        """KV memory (bytes_live, bytes_in_use, bytes_reserved, peak_bytes_in_use; blocks for a
        paged store), `sequences` is filled in by the kit, and optionally `counters`."""
        raise Unsupported(f"{self.name} keeps no statistics")


class Row:
    """One row of a forward, checked: the sequence, its tokens and where its logits are read."""

    __slots__ = ("seq", "tokens", "logits_at")

    def __init__(self, seq, tokens, logits_at):
        self.seq = seq
        self.tokens = tokens
        self.logits_at = logits_at

    def __repr__(self):
        return f"Row(seq={self.seq}, tokens={self.tokens}, logits_at={self.logits_at})"


def capabilities(
    masked_prefix=False,
    share_prefix=False,
    max_batch=None,
    stats=False,
    block_size=None,
    kv_row_bytes=None,
    faults=(),
):
    """hello's capabilities, with the protocol's defaults for what a path does not say."""
    caps = {
        "masked_prefix": bool(masked_prefix),
        "share_prefix": bool(share_prefix),
        "max_batch": max_batch,
        "stats": bool(stats),
        "faults": list(faults),
        "block_size": block_size,
    }
    if kv_row_bytes is not None:
        caps["kv_row_bytes"] = int(kv_row_bytes)
    return caps


def counters(**counts):
    """A stats reply's `counters`: only the counters the engine keeps (never a made-up 0)."""
    unknown = sorted(set(counts) - set(COUNTERS))
    if unknown:
        raise ValueError(f"unknown counters {unknown}; the protocol's are {list(COUNTERS)}")
    return {k: int(v) for k, v in counts.items() if v is not None}


def encode_logits(logits, vocab=None):
    """`[B, vocab]` logits as the protocol carries them: float32 little-endian, base64. Takes
    numpy arrays, MLX arrays (evaluated and cast here) or lists of lists of floats."""
    if isinstance(logits, (list, tuple)):
        rows = [list(map(float, r)) for r in logits]
        shape = [len(rows), len(rows[0]) if rows else 0]
        if any(len(r) != shape[1] for r in rows):
            raise RequestError("logits rows differ in length")
        data = struct.pack(f"<{shape[0] * shape[1]}f", *(x for r in rows for x in r))
    else:
        import numpy as np

        if type(logits).__module__.startswith("mlx"):
            import mlx.core as mx

            logits = logits.astype(mx.float32)
            mx.eval(logits)
        a = np.ascontiguousarray(np.asarray(logits), dtype="<f4")
        if a.ndim != 2:
            raise RequestError(f"logits must be [rows, vocab], got shape {list(a.shape)}")
        shape, data = list(a.shape), a.tobytes()
    if vocab is not None and shape[1] != vocab:
        raise RequestError(f"the engine returned {shape[1]} logits per row, vocab_size is {vocab}")
    return {"dtype": "f32", "shape": shape, "b64": base64.b64encode(data).decode()}


def decode_logits(reply):
    """The inverse of encode_logits (lists of floats): for tests and checks."""
    rows, vocab = reply["shape"]
    flat = struct.unpack(f"<{rows * vocab}f", base64.b64decode(reply["b64"]))
    return [list(flat[i * vocab : (i + 1) * vocab]) for i in range(rows)]


def _int(value, what, minimum=0):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RequestError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


class Server:
    """The protocol loop around one engine: request checks, dispatch, reply checks."""

    def __init__(self, engine):
        self.engine = engine
        self.vocab = None
        self.live = set()

    def seq(self, value, what="seq"):
        if not isinstance(value, int) or value not in self.live:
            raise RequestError(f"{what}: no sequence {value!r} (live: {sorted(self.live)})")
        return value

    def new_seq(self, value, op):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RequestError(f"{op}: the engine returned sequence id {value!r}, not a non-negative integer")
        if value in self.live:
            raise RequestError(f"{op}: the engine returned sequence id {value}, which is live")
        self.live.add(value)
        return value

    def rows(self, raw):
        if not isinstance(raw, list) or not raw:
            raise RequestError("forward needs a non-empty list of rows")
        rows, width = [], None
        for r in raw:
            if not isinstance(r, dict):
                raise RequestError(f"a forward row is not an object: {r!r}")
            seq = self.seq(r.get("seq"), "forward")
            tokens, at = r.get("tokens"), r.get("logits_at")
            if not isinstance(tokens, list) or not tokens:
                raise RequestError(f"sequence {seq}: tokens must be a non-empty list")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in tokens):
                raise RequestError(f"sequence {seq}: every token must be an integer in 0..{self.vocab - 1}")
            if width is None:
                width = len(tokens)
            elif len(tokens) != width:
                raise RequestError("every row of a forward must have the same number of tokens")
            if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at < len(tokens):
                raise RequestError(f"sequence {seq}: logits_at {at!r} is not within its {len(tokens)} tokens")
            rows.append(Row(seq, tokens, at))
        ids = [r.seq for r in rows]
        if len(set(ids)) != len(ids):
            raise RequestError(f"a forward names a sequence twice: {ids}")
        return rows

    def hello(self, req):
        if req.get("protocol") != PROTOCOL:
            raise RequestError(f"this adapter speaks protocol {PROTOCOL}, not {req.get('protocol')!r}")
        self.engine.load(req.get("model"), req.get("path"), req.get("settings") or {})
        d = self.engine.describe()
        self.vocab = _int(d.get("vocab_size"), "describe(): vocab_size", 1)
        if d.get("dtype") not in ("float32", "bfloat16", "float16"):
            raise RequestError(f"describe(): dtype {d.get('dtype')!r} is not float32, bfloat16 or float16")
        engine = {"name": self.engine.name, "version": str(self.engine.version)}
        if self.engine.device is not None:
            engine["device"] = str(self.engine.device)
        return {
            "protocol": PROTOCOL,
            "engine": engine,
            "vocab_size": self.vocab,
            "dtype": d["dtype"],
            "capabilities": d.get("capabilities") or capabilities(),
        }

    def handle(self, req):
        op = req.get("op")
        if op not in OPS:
            raise RequestError(f"unknown op {op!r} (known: {', '.join(OPS)})")
        if op == "hello":
            return self.hello(req)
        if op == "shutdown":
            return {}
        if self.vocab is None:
            raise RequestError("send hello first")
        e = self.engine
        if op == "reset":
            if req.get("faults"):
                raise RequestError(f"this adapter has no planted faults: {req['faults']}")
            e.reset()
            self.live.clear()
            return {}
        if op == "create":
            masked = _int(req.get("masked_prefix", 0), "masked_prefix")
            return {"seq": self.new_seq(e.create(masked), "create")}
        if op == "forward":
            rows = self.rows(req.get("rows"))
            logits, lengths = e.forward(rows)
            lengths = [int(n) for n in lengths]
            if len(lengths) != len(rows):
                raise RequestError(f"the engine returned {len(lengths)} lengths for {len(rows)} rows")
            encoded = encode_logits(logits, self.vocab)
            if encoded["shape"][0] != len(rows):
                raise RequestError(f"the engine returned {encoded['shape'][0]} logits rows for {len(rows)} rows")
            return {"lengths": lengths, "logits": encoded}
        if op == "trim":
            seq, n = self.seq(req.get("seq"), "trim"), _int(req.get("n"), "trim: n")
            removed, length = e.trim(seq, n)
            if int(removed) > n:
                raise RequestError(f"the engine removed {removed} rows when {n} were asked")
            return {"removed": int(removed), "len": int(length)}
        if op == "release":
            seq = self.seq(req.get("seq"), "release")
            e.release(seq)
            self.live.discard(seq)
            return {}
        if op == "share_prefix":
            donor, rows = self.seq(req.get("donor"), "share_prefix"), _int(req.get("rows"), "share_prefix: rows")
            shared = e.share_prefix(donor, rows)
            if shared is None:
                return {"seq": None}
            seq, mode = shared
            if mode not in ("share", "copy"):
                raise RequestError(f"share_prefix: mode {mode!r}, expected \"share\" or \"copy\"")
            return {"seq": self.new_seq(seq, "share_prefix"), "mode": mode}
        # stats
        stats = dict(e.stats())
        stats["sequences"] = len(self.live)
        return {"stats": stats}

    def reply(self, line):
        """The reply to one request line, and the op it answered."""
        try:
            req = json.loads(line)
        except ValueError as err:
            return {"id": None, "ok": False, "error": f"request is not JSON: {err}"}, None
        if not isinstance(req, dict):
            return {"id": None, "ok": False, "error": "request is not a JSON object"}, None
        rid, op = req.get("id"), req.get("op")
        try:
            return {"id": rid, "ok": True, **self.handle(req)}, op
        except Unsupported as err:
            return {"id": rid, "ok": False, "unsupported": True, "error": str(err)}, op
        except RequestError as err:
            return {"id": rid, "ok": False, "error": str(err)}, op
        except Exception as err:  # the engine failed: say so, keep serving
            traceback.print_exc(file=sys.stderr)
            return {"id": rid, "ok": False, "error": f"{type(err).__name__}: {err}"}, op

    def serve(self, inp, out):
        for line in inp:
            if not line.strip():
                continue
            reply, op = self.reply(line)
            out.write(json.dumps(reply) + "\n")
            out.flush()
            if op == "shutdown" and reply["ok"]:
                return


def protocol_stdout():
    """A private handle on stdout for protocol lines; fd 1 (Python and C output alike) then
    goes to stderr, so nothing an engine prints can corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(engine, inp=None, out=None):
    """Serve `engine` on stdin/stdout until shutdown or the end of stdin."""
    out = out if out is not None else protocol_stdout()
    Server(engine).serve(inp if inp is not None else sys.stdin, out)
