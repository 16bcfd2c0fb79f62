"""llama.cpp's own KV cache as parity step-protocol paths, through its C API (llama-cpp-python's
low-level bindings, built by ci/llama-cpp), on the adapter kit (parity_adapter.py).

    ci/llama-cpp adapters/llamacpp_adapter.py --model SmolLM2.gguf --layout per-seq|streams|unified
        [--flash-attn on|off] [--type-k f16|q8_0|q4_0|...] [--type-v ...] [--threads 2]
        [--ctx 512] [--ubatch N] [--swa-full on|off]

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

A model with sliding-window layers (Gemma 3) gets llama.cpp's iSWA memory: a base cache for the
global layers and a window cache for the sliding ones, both holding every cell while swa_full is
on (llama_context_default_params' choice, kept unless --swa-full says otherwise; llama-server's
default is off: window + ubatch cells). The window cache keeps only what a sequence's next token
attends to, so a trim or a copied prefix can leave a sequence without rows its window still
reaches: llama.cpp accepts the cut and computes over what is left; the adapter checks
llama_memory_seq_pos_min as llama-server does and fails the request instead (check_window).

What the adapter reports is read back from llama.cpp, never from its own bookkeeping:
- lengths and trims from llama_memory_seq_pos_max (a trim that removed nothing reads as such);
- the counters from the graphs llama.cpp computed (its eval callback sees each graph's `embd`,
  whose width is the tokens computed, and `result_output`, whose width is the logits rows, one
  per sequence of the forward): model calls, tokens and the most sequences in one call;
- KV memory from llama.cpp's own serialisation of its cells (llama_state_seq_get_data of every
  sequence), one section per KV cache of the memory (Cells): which cells each cache uses, which
  sequences each cell holds, and the type and row size every layer's K and V are stored in.
  kv_row_bytes is what the asked types cost over every layer (ggml's block sizes); a cache that
  stored another type than asked fails parity's row-bytes check. With two caches, each is counted
  at its own row (its layers' K and V as stored): bytes_in_use is the cells each holds, and
  bytes_live the live rows at the sum of the caches' rows, so that a window cache holding fewer
  of a sequence's rows than the base cache changes what is held, not what a row costs
  (LlamaCpp.memory).
"""

import argparse
import ctypes
import re
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
# 4) go to stderr, whose tail parity prints with any error. Of the INFO lines one is kept: each
# KV cache llama.cpp allocates says how many cells a stream of it has, its layers and its streams
# (llama-kv-cache.cpp, llama_kv_cache's constructor), in the order the caches are made (iSWA:
# the base cache, then the window cache, as they are serialised). Module-level: ctypes frees a
# callback whose Python object is collected.
CACHE_LINE = re.compile(rb"^llama_kv_cache: size = +[0-9.]+ MiB \( *(\d+) cells, +(\d+) layers, +\d+/(\d+) seqs\)")
CACHES_MADE = []  # (cells per stream, layers, streams) of each cache, since the last context


@L.llama_log_callback
def log(level, text, _user):
    if level in (3, 4):
        sys.stderr.write(text.decode(errors="replace"))
    m = CACHE_LINE.match(text)
    if m:
        CACHES_MADE.append(tuple(int(g) for g in m.groups()))


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


class Section:
    """One KV cache of a context's memory as llama.cpp serialises it: its used cells (the
    sequence ids each holds), how many of its layers a cell spans, and what a cell stores."""

    def __init__(self, name):
        self.name = name
        self.n_stream = 0
        self.seqs = []  # per used cell: the sequence ids it holds
        self.n_layer = 0  # layers a cell of this cache spans (0: no cell to say)
        self.row_bytes = 0  # K and V of one cell over those layers, as stored
        self.types = set()

    def rows(self):
        """Rows of sequences it holds: each cell once per sequence that holds it."""
        return sum(len(s) for s in self.seqs)


class Cells:
    """One context's KV memory as llama_state_seq_get_data(-1) serialises it
    (llama-context.cpp state_seq_get_data): the magic and the sequence id, then one section
    per KV cache of the memory, each as llama_kv_cache::state_write writes it (llama-kv-cache.cpp:
    its stream count, then per stream its used cells, each cell's position and sequence ids
    (state_write_meta), and per layer the K then the V type, row size and rows of those cells
    (state_write_data)). A plain llama_kv_cache is one section. llama_kv_cache_iswa (a model with
    sliding-window layers, Gemma 3) is two, one after the other, with no length between them
    (llama-kv-cache-iswa.cpp state_write): its base cache (the global layers) and its window
    cache (the sliding layers). Every byte must be accounted for, section after section, and
    together the sections must span the model's layers: a state laid out otherwise is refused,
    never guessed at."""

    def __init__(self, data, sections=("kv",), n_layer=None):
        self.data, self.at = data, 0
        magic, _seq = self.take("<Ii")
        if magic != STATE_MAGIC:
            raise RequestError(f"llama.cpp's sequence state starts with {magic:#x}, not {STATE_MAGIC:#x}")
        self.sections = [self.section(name) for name in sections]
        if self.at != len(self.data):
            raise RequestError(
                f"llama.cpp's sequence state is {len(self.data)} bytes, its {len(sections)} cache(s) "
                f"({', '.join(sections)}) account for {self.at}: a state format this adapter does not know"
            )
        if len({s.n_stream for s in self.sections}) > 1:
            raise RequestError(f"llama.cpp's caches have {[s.n_stream for s in self.sections]} streams, not one count")
        spanned = [s.n_layer for s in self.sections]
        if n_layer is not None and all(s.seqs for s in self.sections) and sum(spanned) != n_layer:
            raise RequestError(f"llama.cpp's caches span {spanned} layers, not the model's {n_layer}")
        # What the adapter reads everywhere else: the cells of the first cache (a plain cache's
        # only one; iSWA's base cache, which llama.cpp keeps a superset of the window cache,
        # llama_kv_cache_iswa::seq_pos_min), and what one row costs over every layer.
        self.seqs = self.sections[0].seqs
        self.row_bytes = sum(s.row_bytes for s in self.sections)
        self.types = set().union(*(s.types for s in self.sections))

    def section(self, name):
        sec = Section(name)
        (sec.n_stream,) = self.take("<I")
        for _ in range(sec.n_stream):
            (count,) = self.take("<I")
            if count == 0:
                continue
            cells = []
            for _ in range(count):
                _pos, n = self.take("<iI")
                cells.append(self.take(f"<{n}i"))
            sec.seqs.extend(cells)
            v_trans, n_layer = self.take("<II")
            row = 0
            for _ in range(n_layer):
                kind, size = self.take("<iQ")
                row += size
                sec.types.add(("K", TYPE_NAMES.get(kind, f"ggml type {kind}")))
                self.skip(size * count)
            for _ in range(n_layer):
                if v_trans:
                    kind, el, n_embd = self.take("<iII")
                    size = el * n_embd
                else:
                    kind, size = self.take("<iQ")
                row += size
                sec.types.add(("V", TYPE_NAMES.get(kind, f"ggml type {kind}")))
                self.skip(size * count)
            if sec.row_bytes and (row, n_layer) != (sec.row_bytes, sec.n_layer):
                raise RequestError(
                    f"llama.cpp's {name} cache has streams of {sec.n_layer} and {n_layer} layers, "
                    f"rows of {sec.row_bytes} and {row} bytes"
                )
            sec.row_bytes, sec.n_layer = row, n_layer
        return sec

    def take(self, fmt):
        n = struct.calcsize(fmt)
        if self.at + n > len(self.data):
            raise RequestError("llama.cpp's sequence state ends early")
        out = struct.unpack_from(fmt, self.data, self.at)
        self.at += n
        return out

    def skip(self, n):
        if self.at + n > len(self.data):
            raise RequestError("llama.cpp's sequence state ends early")
        self.at += n


class Context:
    """A llama_context, the llama.cpp sequence ids it has free, and the KV caches of its memory
    (one, or iSWA's two: base and window), each with the cells llama.cpp allocated for it."""

    def __init__(self, engine, n_seq, unified):
        p = L.llama_context_default_params()
        p.n_seq_max = n_seq
        p.n_ctx = engine.ctx_per_seq * n_seq
        # A forward may hold every sequence's rows (llama_decode asserts, and aborts the process,
        # on a batch of more tokens than n_batch); a graph holds at most one sequence's worth.
        p.n_batch = engine.ctx_per_seq * n_seq
        p.n_ubatch = engine.args.ubatch or engine.ctx_per_seq
        p.kv_unified = unified
        p.flash_attn_type = FLASH[engine.args.flash_attn]
        p.type_k = KV_TYPES[engine.args.type_k][0]
        p.type_v = KV_TYPES[engine.args.type_v][0]
        if engine.args.swa_full != "default":
            p.swa_full = engine.args.swa_full == "on"
        p.n_threads = p.n_threads_batch = engine.args.threads
        p.cb_eval = engine.graphs.callback
        p.no_perf = True
        CACHES_MADE.clear()
        self.ctx = L.llama_init_from_model(engine.model, p)
        if not self.ctx:
            raise RequestError(
                f"llama_init_from_model refused the context (n_seq_max {n_seq}, flash attention "
                f"{engine.args.flash_attn}, K {engine.args.type_k}, V {engine.args.type_v}); its log is on stderr"
            )
        self.engine = engine
        self.sections = engine.sections
        if len(CACHES_MADE) != len(self.sections):
            raise RequestError(
                f"llama.cpp logged {len(CACHES_MADE)} KV caches for this context, the adapter expects "
                f"{len(self.sections)} ({', '.join(self.sections)})"
            )
        # Cells llama.cpp allocated per cache, all streams: what bytes_reserved counts.
        self.cells_made = [cells * streams for cells, _layers, streams in CACHES_MADE]
        self.layers_made = [layers for _cells, layers, _streams in CACHES_MADE]
        self.mem = L.llama_get_memory(self.ctx)
        self.free = list(range(n_seq))[::-1]

    def length(self, sid):
        return L.llama_memory_seq_pos_max(self.mem, sid) + 1

    def cells(self):
        n = L.llama_state_seq_get_size(self.ctx, -1)
        buf = (ctypes.c_uint8 * n)()
        got = L.llama_state_seq_get_data(self.ctx, buf, n, -1)
        if got != n:
            raise RequestError(f"llama_state_seq_get_data wrote {got} of {n} bytes")
        return Cells(bytes(buf), self.sections, self.engine.n_layer)


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
        self.last_cells = None

    def load(self, model, path, settings):
        L.llama_log_set(log, None)
        L.llama_backend_init()
        p = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(self.args.model.encode(), p)
        if not self.model:
            raise RequestError(f"{self.args.model}: llama.cpp could not load this GGUF")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        if L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model):
            raise RequestError(f"{self.args.model}: a recurrent or hybrid memory, whose state this adapter does not read")
        self.n_layer = n_layer = L.llama_model_n_layer(self.model)
        # A sliding window: llama.cpp gives the model an iSWA memory, two KV caches (a base one
        # for the global layers, a window one for the sliding layers), serialised one after the
        # other (llama-model.cpp create_memory; llama-kv-cache-iswa.cpp).
        self.n_swa = L.llama_model_n_swa(self.model)
        self.sections = ("base", "window") if self.n_swa > 0 else ("kv",)
        heads = L.llama_model_n_head_kv(self.model)
        k, v = (heads * self.head_dim(kind) for kind in ("key", "value"))
        # One row, one token over every layer, in the types asked: K and V of each layer are in
        # exactly one of the caches, so a row costs this whichever cache keeps which layer.
        self.layer_bytes = row_size(self.args.type_k, k) + row_size(self.args.type_v, v)
        self.kv_row_bytes = n_layer * self.layer_bytes
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
        if n > L.llama_n_batch(ctx.ctx):
            raise RequestError(f"a forward of {n} tokens is more than llama.cpp's n_batch {L.llama_n_batch(ctx.ctx)}")
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
        self.check_window(ctx, sid, f"sequence {seq} trimmed to {after} rows")
        return before - after, after

    def check_window(self, ctx, sid, what):
        """A sequence cut back (a trim, a copied prefix) must still hold every row its next
        token's window reaches. llama.cpp's window cache keeps only what the sequence's last
        position needs (llama_state_seq_get_data of one sequence leaves out the cells outside
        that window; with swa_full off find_slot overwrites them), llama_memory_seq_rm returns
        true all the same and llama_decode then attends to what is left (ci/repro/
        llamacpp_swa_cut.py). llama_memory_seq_pos_min says what is there; llama-server checks it
        (server-context.cpp, pos_min_thold) and reprocesses the prompt. So does this adapter,
        and refuses what llama.cpp can no longer compute (a standard window: the next position p
        attends to p - n_swa + 1 ..)."""
        if self.n_swa <= 0:
            return
        length = ctx.length(sid)
        if length == 0:
            return
        need = max(0, length - self.n_swa + 1)
        have = L.llama_memory_seq_pos_min(ctx.mem, sid)
        if have > need:
            raise RequestError(
                f"{what}: llama.cpp's window cache holds it from position {have}, the window of its next "
                f"position {length} reaches back to {need} (rows the window had already left are gone; "
                "llama_memory_seq_rm returned true)"
            )

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
        self.check_window(ctx, sid, f"a copy of sequence {donor}'s first {rows} rows")
        if mode == "share":
            self.shared += rows
        else:
            self.copied += rows
        self.note_peak()
        return seq, mode

    def memory(self):
        """KV memory over every context, read from llama.cpp's serialised cells (Cells), each
        cache of a context counted at what one of its cells stores (K and V over its layers):

        - bytes_in_use: the cells every cache holds, each once, at its cache's row size: what is
          held. An iSWA window cache holds at most its window (plus a ubatch) of a sequence's
          rows once llama.cpp overwrites cells that left the window (swa_full off), so this is
          less than the rows times a whole row;
        - bytes_live: the live rows of the sequences (the cache that holds the most: a plain
          cache's cells, iSWA's base cache, each cell once per sequence holding it) at what one
          row is stored in, summed over the caches. A window cache that no longer holds a
          sequence's oldest rows does not lower it: a row's cost is measured in every cache from
          the rows it does hold, and parity's row-bytes check (bytes_live / live rows against
          kv_row_bytes, every layer in the types asked) stays a check of what each cache stores
          per row, not of how many rows a window keeps;
        - bytes_reserved: the cells llama.cpp allocated for each cache (its log), at that
          cache's row size (as the types cost, for a cache that holds no cell yet).
        """
        live = in_use = reserved = 0
        types = set()
        for c in self.contexts:
            cells = c.cells()
            rows = max(sec.rows() for sec in cells.sections)
            live += rows * cells.row_bytes
            for sec, made, layers in zip(cells.sections, c.cells_made, c.layers_made):
                in_use += len(sec.seqs) * sec.row_bytes
                reserved += made * (sec.row_bytes or layers * self.layer_bytes)
            types |= cells.types
            self.last_cells = cells
        return live, in_use, reserved, types

    def note_peak(self):
        self.peak = max(self.peak, self.memory()[1])

    def stats(self):
        live, in_use, reserved, types = self.memory()
        if types and types != self.told:
            self.told = types
            print(f"llama.cpp stores {', '.join(f'{a} as {t}' for a, t in sorted(types))}", file=sys.stderr)
            for sec in self.last_cells.sections if len(self.sections) > 1 else ():
                print(
                    f"  its {sec.name} cache: {sec.n_layer} layers, {sec.row_bytes} bytes a cell "
                    f"({sec.n_layer * self.layer_bytes} in the types asked), {len(sec.seqs)} cells held",
                    file=sys.stderr,
                )
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
    p.add_argument("--ctx", type=int, default=512, help="KV rows per sequence (n_batch: that for every sequence of the context)")
    p.add_argument("--ubatch", type=int, default=0, help="n_ubatch: rows of one graph (default: --ctx)")
    p.add_argument(
        "--swa-full",
        choices=("default", "on", "off"),
        default="default",
        help="a sliding-window model's window cache as large as the base one (llama_context_default_params: "
        "on; llama-server's default: off, window + ubatch cells)",
    )
    serve(LlamaCpp(p.parse_args()))


if __name__ == "__main__":
    main()
