"""llama.cpp's own KV cache as parity step-protocol paths, through its C API (llama-cpp-python's
low-level bindings, built by ci/llama-cpp), on the adapter kit (parity_adapter.py).

    ci/llama-cpp adapters/llamacpp_adapter.py --model SmolLM2.gguf --layout per-seq|streams|unified
        [--flash-attn on|off] [--type-k f16|q8_0|q4_0|...] [--type-v ...] [--threads 2]

Layouts (how parity's sequences map onto llama.cpp's memory):
- per-seq: one llama_context per sequence (n_seq_max 1): every sequence alone in its own KV
  cache, a forward's rows decoded one context at a time. The reference.
- streams: one context, n_seq_max sequences, kv_unified off: each sequence has its own KV
  stream, and a forward's rows go to llama_decode as one batch.
- unified: one context, one KV buffer of cells that every sequence draws from (kv_unified on).

A trim is llama_memory_seq_rm of the newest rows; a release removes the whole sequence. A
shared prefix is llama.cpp's own: llama_memory_seq_cp of the donor's first rows (unified: the
cells gain the new sequence's id, no data moves, so `share`; streams: llama.cpp copies only whole
streams, so the donor's stream is copied and the rows past the prefix removed, `copy`);
per-seq copies the donor context's sequence state into a fresh context (llama_state_seq_get_data
/ set_data) and removes the rows past the prefix, `copy`. Masked prefixes are not offered: every
layout would have to emulate them.

What the adapter reports is read back from llama.cpp, never from its own bookkeeping:
- lengths and trims from llama_memory_seq_pos_max (a trim that removed nothing reads as such);
- the counters from the graphs llama.cpp computed (its eval callback sees each graph's `embd`,
  whose width is the tokens computed, and `result_output`, whose width is the logits rows, one
  per sequence of the forward): model calls, tokens and the most sequences in one call;
- KV memory from llama.cpp's own serialisation of its cells (llama_state_seq_get_data of every
  sequence): which cells are used, which sequences each holds, and the type and row size every
  layer's K and V are stored in. kv_row_bytes is what the asked types cost (ggml's block
  sizes); a cache that stored another type than asked fails parity's row-bytes check.
"""

import argparse
import ctypes
import struct
import sys

import numpy as np

import llama_cpp as L
from parity_adapter import Engine, RequestError, Unsupported, capabilities, counters, serve

# ggml's types a KV cache may be stored in: name -> (ggml_type id, bytes per block, values per block).
KV_TYPES = {
    "f32": (0, 4, 1),
    "f16": (1, 2, 1),
    "q4_0": (2, 18, 32),
    "q4_1": (3, 20, 32),
    "q5_0": (6, 22, 32),
    "q5_1": (7, 24, 32),
    "q8_0": (8, 34, 32),
    "bf16": (30, 2, 1),
}
TYPE_NAMES = {v[0]: k for k, v in KV_TYPES.items()}
FLASH = {"auto": -1, "off": 0, "on": 1}
# The state format's magic (llama-context.cpp, io_magic), read back as a check of the format.
STATE_MAGIC = 0xAF143CD8


def row_size(kind, n):
    _, size, per = KV_TYPES[kind]
    if n % per:
        raise RequestError(f"a row of {n} values is not whole blocks of {kind} ({per} values)")
    return n // per * size


# llama.cpp logs every context it makes at INFO; its warnings and errors (ggml's levels 3 and
# 4) go to stderr, whose tail parity prints with any error. Module-level: ctypes frees a callback
# whose Python object is collected.
@L.llama_log_callback
def log(level, text, _user):
    if level in (3, 4):
        sys.stderr.write(text.decode(errors="replace"))


class Tensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor, up to `name` (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS
    64 bytes, GGML_MAX_SRC 10, GGML_MAX_NAME 64 in this build)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


class Graphs:
    """What llama.cpp computed, seen through its eval callback: one graph per ubatch."""

    WATCHED = (b"embd", b"result_output")

    def __init__(self):
        self.zero()
        # Kept as an attribute: ctypes frees a callback whose Python object is collected.
        self.callback = L.ggml_backend_sched_eval_callback(self.see)

    def zero(self):
        self.forwards = self.tokens = self.max_rows = 0

    def see(self, t, ask, _user):
        name = ctypes.cast(t, ctypes.POINTER(Tensor)).contents.name
        if name not in self.WATCHED:
            return not ask  # ask: not this one; told: keep computing
        if not ask:
            width = ctypes.cast(t, ctypes.POINTER(Tensor)).contents.ne[1]
            if name == b"embd":
                self.tokens += width
            else:
                self.forwards += 1
                self.max_rows = max(self.max_rows, width)
        return True


class Cells:
    """One context's KV cells as llama.cpp serialises them (llama-kv-cache.cpp state_write)."""

    def __init__(self, data):
        self.data, self.at = data, 0
        magic, _seq, n_stream = self.take("<IiI")
        if magic != STATE_MAGIC:
            raise RequestError(f"llama.cpp's sequence state starts with {magic:#x}, not {STATE_MAGIC:#x}")
        self.seqs = []  # per used cell: the sequence ids it holds
        self.row_bytes = 0  # K and V of one cell, all layers, as stored
        self.types = set()
        for _ in range(n_stream):
            (count,) = self.take("<I")
            if count == 0:
                continue
            cells = []
            for _ in range(count):
                _pos, n = self.take("<iI")
                cells.append(self.take(f"<{n}i"))
            self.seqs.extend(cells)
            v_trans, n_layer = self.take("<II")
            row = 0
            for _ in range(n_layer):
                kind, size = self.take("<iQ")
                row += size
                self.types.add(("K", TYPE_NAMES.get(kind, f"ggml type {kind}")))
                self.at += size * count
            for _ in range(n_layer):
                if v_trans:
                    kind, el, n_embd = self.take("<iII")
                    size = el * n_embd
                else:
                    kind, size = self.take("<iQ")
                row += size
                self.types.add(("V", TYPE_NAMES.get(kind, f"ggml type {kind}")))
                self.at += size * count
            if self.row_bytes and row != self.row_bytes:
                raise RequestError(f"llama.cpp's streams store rows of {self.row_bytes} and {row} bytes")
            self.row_bytes = row
        if self.at != len(self.data):
            raise RequestError(
                f"llama.cpp's sequence state is {len(self.data)} bytes, its cells account for {self.at}: "
                "a state format this adapter does not know"
            )

    def take(self, fmt):
        n = struct.calcsize(fmt)
        if self.at + n > len(self.data):
            raise RequestError("llama.cpp's sequence state ends early")
        out = struct.unpack_from(fmt, self.data, self.at)
        self.at += n
        return out


class Context:
    """A llama_context and the llama.cpp sequence ids it has free."""

    def __init__(self, engine, n_seq, unified):
        p = L.llama_context_default_params()
        p.n_seq_max = n_seq
        p.n_ctx = engine.ctx_per_seq * n_seq
        p.n_batch = p.n_ubatch = engine.ctx_per_seq
        p.kv_unified = unified
        p.flash_attn_type = FLASH[engine.args.flash_attn]
        p.type_k = KV_TYPES[engine.args.type_k][0]
        p.type_v = KV_TYPES[engine.args.type_v][0]
        p.n_threads = p.n_threads_batch = engine.args.threads
        p.cb_eval = engine.graphs.callback
        p.no_perf = True
        self.ctx = L.llama_init_from_model(engine.model, p)
        if not self.ctx:
            raise RequestError(
                f"llama_init_from_model refused the context (n_seq_max {n_seq}, flash attention "
                f"{engine.args.flash_attn}, K {engine.args.type_k}, V {engine.args.type_v}); its log is on stderr"
            )
        self.mem = L.llama_get_memory(self.ctx)
        self.cells_total = L.llama_n_ctx(self.ctx)
        self.free = list(range(n_seq))[::-1]

    def length(self, sid):
        return L.llama_memory_seq_pos_max(self.mem, sid) + 1

    def cells(self):
        n = L.llama_state_seq_get_size(self.ctx, -1)
        buf = (ctypes.c_uint8 * n)()
        got = L.llama_state_seq_get_data(self.ctx, buf, n, -1)
        if got != n:
            raise RequestError(f"llama_state_seq_get_data wrote {got} of {n} bytes")
        return Cells(bytes(buf))


class LlamaCpp(Engine):
    name = "llama.cpp"
    version = f"llama-cpp-python {L.__version__}"

    def __init__(self, args):
        self.args = args
        self.ctx_per_seq = args.ctx
        self.graphs = Graphs()
        self.batch = None
        self.contexts = []
        self.seqs = {}  # protocol seq -> (Context, llama.cpp seq id)
        self.next_id = 0
        self.told = set()  # the stored K/V types last written to stderr

    def load(self, model, path, settings):
        L.llama_log_set(log, None)
        L.llama_backend_init()
        p = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(self.args.model.encode(), p)
        if not self.model:
            raise RequestError(f"{self.args.model}: llama.cpp could not load this GGUF")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        n_layer = L.llama_model_n_layer(self.model)
        heads = L.llama_model_n_head_kv(self.model)
        k, v = (heads * self.head_dim(kind) for kind in ("key", "value"))
        self.kv_row_bytes = n_layer * (row_size(self.args.type_k, k) + row_size(self.args.type_v, v))
        self.batch = L.llama_batch_init(self.ctx_per_seq * self.args.n_seq, 0, 1)
        self.reset()

    def head_dim(self, kind):
        """K's or V's head size: the GGUF's `<arch>.attention.{key,value}_length` where it says
        (Gemma 3: 256, not hidden / heads = 160), else hidden / heads, as llama.cpp defaults it."""
        buf = ctypes.create_string_buffer(64)
        arch = L.llama_model_meta_val_str(self.model, b"general.architecture", buf, len(buf)) > 0 and buf.value
        key = b"%s.attention.%s_length" % (arch or b"", kind.encode())
        if arch and L.llama_model_meta_val_str(self.model, key, buf, len(buf)) > 0:
            return int(buf.value)
        return L.llama_model_n_embd(self.model) // L.llama_model_n_head(self.model)

    def describe(self):
        caps = capabilities(share_prefix=True, stats=True, kv_row_bytes=self.kv_row_bytes)
        return {"vocab_size": self.vocab, "dtype": "float32", "capabilities": caps}

    def reset(self):
        for c in self.contexts:
            L.llama_memory_clear(c.mem, True)
            c.free = list(range(L.llama_n_seq_max(c.ctx)))[::-1]
        if self.args.layout != "per-seq" and not self.contexts:
            self.contexts.append(Context(self, self.args.n_seq, self.args.layout == "unified"))
        self.seqs, self.next_id = {}, 0
        self.graphs.zero()
        self.trimmed = self.shared = self.copied = 0
        self.peak = 0

    def place(self):
        """A free llama.cpp sequence: in the one context, or (per-seq) a context of its own."""
        if self.args.layout == "per-seq":
            for c in self.contexts:
                if c.free:
                    return c, c.free.pop()
            self.contexts.append(Context(self, 1, False))
            return self.contexts[-1], self.contexts[-1].free.pop()
        c = self.contexts[0]
        if not c.free:
            raise RequestError(f"all {self.args.n_seq} llama.cpp sequences of the context are live (--n-seq)")
        return c, c.free.pop()

    def create(self, masked_prefix):
        if masked_prefix:
            raise Unsupported("llama.cpp's KV cache has no masked rows: every cell is attended by position")
        seq = self.next_id
        self.next_id += 1
        self.seqs[seq] = self.place()
        return seq

    def forward(self, rows):
        by_ctx = {}
        for i, row in enumerate(rows):
            by_ctx.setdefault(id(self.seqs[row.seq][0]), []).append(i)
        logits = [None] * len(rows)
        for idx in by_ctx.values():
            ctx = self.seqs[rows[idx[0]].seq][0]
            if self.args.layout == "per-seq":
                for i in idx:
                    logits[i] = self.decode(ctx, [rows[i]])[0]
            else:
                for i, l in zip(idx, self.decode(ctx, [rows[i] for i in idx])):
                    logits[i] = l
        self.note_peak()
        return np.stack(logits), [self.length(row.seq) for row in rows]

    def decode(self, ctx, rows):
        b, n, outs = self.batch, 0, []
        for row in rows:
            sid = self.seqs[row.seq][1]
            start = ctx.length(sid)
            if start + len(row.tokens) > self.ctx_per_seq:
                raise RequestError(f"sequence {row.seq} would grow past {self.ctx_per_seq} rows (--ctx)")
            for j, t in enumerate(row.tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = t, start + j, 1
                b.seq_id[n][0] = sid
                b.logits[n] = j == row.logits_at
                if j == row.logits_at:
                    outs.append(n)
                n += 1
        b.n_tokens = n
        rc = L.llama_decode(ctx.ctx, b)
        if rc != 0:
            raise RequestError(f"llama_decode returned {rc} for {len(rows)} rows of {len(rows[0].tokens)} tokens")
        return [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx.ctx, i), shape=(self.vocab,)).copy() for i in outs]

    def length(self, seq):
        ctx, sid = self.seqs[seq]
        return ctx.length(sid)

    def trim(self, seq, n):
        ctx, sid = self.seqs[seq]
        before = ctx.length(sid)
        if not L.llama_memory_seq_rm(ctx.mem, sid, before - n, -1):
            raise RequestError(f"llama_memory_seq_rm refused to remove rows {before - n}.. of sequence {seq}")
        after = ctx.length(sid)
        self.trimmed += before - after
        return before - after, after

    def release(self, seq):
        ctx, sid = self.seqs.pop(seq)
        L.llama_memory_seq_rm(ctx.mem, sid, -1, -1)
        ctx.free.append(sid)

    def share_prefix(self, donor, rows):
        dctx, dsid = self.seqs[donor]
        seq = self.create(0)
        ctx, sid = self.seqs[seq]
        if self.args.layout == "unified":
            L.llama_memory_seq_cp(ctx.mem, dsid, sid, 0, rows)
            mode = "share"
        elif self.args.layout == "streams":
            # Across streams llama.cpp copies whole streams only (it asserts on a range).
            L.llama_memory_seq_cp(ctx.mem, dsid, sid, -1, -1)
            mode = "copy"
        else:
            n = L.llama_state_seq_get_size(dctx.ctx, dsid)
            buf = (ctypes.c_uint8 * n)()
            if L.llama_state_seq_get_data(dctx.ctx, buf, n, dsid) != n:
                raise RequestError(f"llama_state_seq_get_data could not save sequence {donor}")
            if L.llama_state_seq_set_data(ctx.ctx, buf, n, sid) == 0:
                raise RequestError(f"llama_state_seq_set_data could not load sequence {donor}'s state")
            mode = "copy"
        if mode == "copy" and not L.llama_memory_seq_rm(ctx.mem, sid, rows, -1):
            raise RequestError(f"llama_memory_seq_rm refused to cut the copied prefix to {rows} rows")
        got = ctx.length(sid)
        if got != rows:
            raise RequestError(f"the new sequence holds {got} rows of the donor's, not {rows}")
        if mode == "share":
            self.shared += rows
        else:
            self.copied += rows
        self.note_peak()
        return seq, mode

    def memory(self):
        live = in_use = reserved = 0
        types = set()
        for c in self.contexts:
            cells = c.cells()
            live += sum(len(s) for s in cells.seqs) * cells.row_bytes
            in_use += len(cells.seqs) * cells.row_bytes
            reserved += c.cells_total * (cells.row_bytes or self.kv_row_bytes)
            types |= cells.types
        return live, in_use, reserved, types

    def note_peak(self):
        self.peak = max(self.peak, self.memory()[1])

    def stats(self):
        live, in_use, reserved, types = self.memory()
        if types and types != self.told:
            self.told = types
            print(f"llama.cpp stores {', '.join(f'{a} as {t}' for a, t in sorted(types))}", file=sys.stderr)
        g = self.graphs
        return {
            "bytes_live": live,
            "bytes_in_use": in_use,
            "bytes_reserved": reserved,
            "peak_bytes_in_use": max(self.peak, in_use),
            "counters": counters(
                forwards=g.forwards,
                max_rows=g.max_rows,
                tokens=g.tokens,
                rows_trimmed=self.trimmed,
                rows_shared=self.shared,
                rows_copied=self.copied,
            ),
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--layout", choices=("per-seq", "streams", "unified"), required=True)
    p.add_argument("--flash-attn", choices=tuple(FLASH), default="auto")
    p.add_argument("--type-k", choices=tuple(KV_TYPES), default="f16")
    p.add_argument("--type-v", choices=tuple(KV_TYPES), default="f16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-seq", type=int, default=8, help="sequences one context holds (streams, unified)")
    p.add_argument("--ctx", type=int, default=512, help="KV rows per sequence")
    serve(LlamaCpp(p.parse_args()))


if __name__ == "__main__":
    main()
