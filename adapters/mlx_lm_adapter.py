"""parity step-protocol adapter for mlx-lm 0.32.2: mlx-lm's own model code and KV-cache
classes (mlx_lm/models/cache.py), served over the JSON-lines protocol in docs/step-protocol.md.

    ci/mlx-lm adapters/mlx_lm_adapter.py --model DIR --cache kv [--dequantize]
    ci/mlx-lm adapters/mlx_lm_adapter.py --model DIR --cache batch
    ci/mlx-lm adapters/mlx_lm_adapter.py --model DIR --cache batch-model
    ci/mlx-lm adapters/mlx_lm_adapter.py --model DIR --cache quantized [--bits 8 --group-size 64]
    ci/mlx-lm adapters/mlx_lm_adapter.py --model DIR --cache rotating --max-size 4096

One process serves one path (`--cache`). It reads one request per line on stdin and writes one
reply per line on stdout; everything else (library output included) goes to stderr. It exits
on `shutdown` or at the end of stdin. The model is loaded with mlx_lm.utils.load_model, cast
to `--dtype` (float32 by default) the way `mlx_lm convert --dtype` casts (scales and biases of
quantized layers included), and with `--dequantize` turned into plain Linear/Embedding layers by
mlx_lm.utils.dequantize_model (MLX's CPU quantized matmul runs on one thread; parity's builtin
offers the same switch). The device follows PARITY_DEVICE (auto|cpu|gpu) as parity does.

The paths (`--cache`):

  kv         KVCache, one per sequence per layer: the reference path. A forward with B rows
             runs the rows one by one, each on its own cache (KVCache batches only sequences
             of equal length, so one-by-one is the honest route). A sliding-window model
             (Gemma 3) keeps every row here and its mask applies the window.
  model      the caches the model's make_cache builds (make_prompt_cache), one set per
             sequence, rows one by one: for Gemma 3, RotatingKVCache(max_size=sliding_window)
             on its sliding layers, KVCache on the global ones; for other models, KVCache.
  batch      BatchKVCache: every forward, B=1 included, is ONE model call on mlx-lm's batch
             caches, composed the way its BatchGenerator composes its batches. A sequence
             outside the live batch holds its own caches (here a KVCache per layer). The live
             batch is kept while the set of sequences in a forward is unchanged. When it changes:
             sequences that leave are `extract`ed into their own caches and `filter`ed out
             (GenerationBatch.filter / BatchGenerator.remove), sequences that join are merged
             from their own caches by _merge_caches (each cache class's `merge`: KVCache.merge is
             BatchKVCache.merge) and the live batch is `extend`ed with them
             (GenerationBatch.extend). Rows keep the batch's order; logits are returned in request
             order. A masked prefix (`create` with masked_prefix m) is left padding: a joining
             sequence that has not been written yet is merged from fresh caches (an empty batch
             cache) and gets `prepare(left_padding=[m])`, so its first m rows are masked and RoPE
             positions start at -m. `extract` drops left padding, so a sequence outside the live
             batch holds only its real rows; its reported length is m + real rows. Trims: mlx-lm
             trims a batch cache by the same n on every row, so a trim of a sequence that is alone
             in the live batch goes through trim_prompt_cache on the batch caches (their own
             is_trimmable and trim); a trim of one row of a larger batch first `extract`s that row
             into its own caches (mlx-lm's mechanism; no per-row batch trim exists) and trims
             those. share_prefix `extract`s (or deep-copies) the donor and trims the copy.
  batch-model  the same composition on what BatchGenerator builds for the model: each
             sequence's own caches are make_prompt_cache's (insert_segments), so _merge_caches
             gives, for Gemma 3, BatchRotatingKVCache(max_size=sliding_window) on its sliding
             layers (RotatingKVCache.merge) and BatchKVCache on the global ones, and `extract`
             hands back a RotatingKVCache or a KVCache; for models without make_cache it is
             `batch`. A trim any of them refuses (BatchRotatingKVCache.is_trimmable: the
             batch's buffer writes, `_offset`, below the window; RotatingKVCache's: its offset
             below it) is an error naming the class, as for `model`. What mlx-lm 0.32.2 does
             on it (a masked key after the window wraps, refused trims): docs/results.md.
  quantized  QuantizedKVCache(group_size, bits), one per sequence per layer; mlx-lm's models
             then run quantized_scaled_dot_product_attention. Rows run one by one as for kv.
             A model whose head_dim is not a multiple of --group-size cannot use it (mx.quantize
             groups the last dimension): `create` answers unsupported.
  rotating   RotatingKVCache(max_size=--max-size, keep=4, as make_prompt_cache builds it), one
             per sequence per layer. With a window larger than any run it must equal kv.

Rules this adapter keeps (see the protocol): trims go through mlx-lm's trim_prompt_cache and
report what it returned (`removed`) and the cache's resulting offset (`len`), never what was
asked; a cache mlx-lm reports as not trimmable (can_trim_prompt_cache false) is an error
naming the first layer's class that refused.
share_prefix answers `mode: "copy"` (copy.deepcopy or extract, then mlx-lm's trim, as
LRUPromptCache.fetch_nearest_cache does) and `unsupported` where mlx-lm cannot trim the copy.
No cache surgery beyond mlx-lm's own methods. Logits are float32 little-endian base64, exact.
Stats: KV bytes from the caches' nbytes (allocated) and rows x bytes-per-row (live); no blocks.
The bytes per row the layout promises (hello's kv_row_bytes) are computed from the model's
shape and the cache's dtype or quantization, not measured, so parity can hold the measured
bytes to them. Counters (in every stats reply, zeroed by reset): model calls and the most rows
one of them computed (kv, model, quantized and rotating run a forward's rows one call each),
tokens computed, rows trimmed (what trim_prompt_cache returned), rows copied by share_prefix.
"""

import argparse
import copy
import os
import sys
import traceback
from pathlib import Path

from parity_adapter import Engine, RequestError, Unsupported, capabilities, serve

DTYPE_NAMES = ("float32", "bfloat16", "float16", "native")


# --- model loading ------------------------------------------------------------------------


def pick_device(mx):
    """Set MLX's default device as PARITY_DEVICE says; return it as hello names it."""
    wanted = os.environ.get("PARITY_DEVICE", "auto") or "auto"
    if wanted not in ("auto", "cpu", "gpu"):
        sys.exit(f"PARITY_DEVICE={wanted}: expected auto, cpu or gpu")
    if wanted == "cpu" or (wanted == "auto" and sys.platform != "darwin"):
        mx.set_default_device(mx.cpu)
    elif wanted == "gpu":
        # Metal on macOS, CUDA where the mlx-cuda wheel is installed (mx.cuda exists in 0.32).
        cuda = getattr(mx, "cuda", None)
        if not (mx.metal.is_available() or (cuda is not None and cuda.is_available())):
            sys.exit("PARITY_DEVICE=gpu but this MLX has no GPU backend (neither Metal nor CUDA)")
        mx.set_default_device(mx.gpu)
    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"


def cast_model(mx, model, dtype):
    """Cast every floating parameter (scales/biases of quantized layers too), as
    `mlx_lm convert --dtype` and ci/bench_mlx_lm.py do."""
    from mlx.utils import tree_map_with_path

    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, value):
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


def compute_dtype_name(mx, model):
    from mlx.utils import tree_flatten

    names = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return names.get(value.dtype, "float32")
    return "float32"


def load_model(mx, directory, dtype, dequantize):
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load_model as mlx_lm_load_model

    model, config = mlx_lm_load_model(Path(directory))
    if dtype != "native":
        cast_model(mx, model, getattr(mx, dtype))
    if dequantize:
        model = dequantize_model(model)
    mx.eval(model.parameters())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise RequestError(f"{directory}/config.json has no vocab_size")
    return model, config, int(vocab)


# --- cache helpers --------------------------------------------------------------------------


def allocated_rows(cache):
    """Rows allocated in one layer's cache, over all its batch rows."""
    keys = cache.keys
    if keys is None:
        return 0
    first = keys[0] if isinstance(keys, (tuple, list)) else keys
    return first.shape[0] * first.shape[-2]


def row_bytes(cache):
    """Bytes of K and V one row occupies in this layer's cache (0 when nothing is allocated)."""
    rows = allocated_rows(cache)
    return cache.nbytes / rows if rows else 0.0


def untrimmable(cache):
    """The class name of the first cache in a list that mlx-lm says cannot be trimmed."""
    return next((type(c).__name__ for c in cache if not c.is_trimmable()), type(cache[0]).__name__)


def one_offset(values, what):
    """The single offset every layer agrees on; layers that disagree are an error."""
    distinct = sorted(set(values))
    if len(distinct) != 1:
        raise RequestError(f"{what}: the layers' caches disagree on the offset: {distinct}")
    return distinct[0]


class Seq:
    """One protocol sequence. `cache` is its own per-layer cache list (None while it has none of
    its own, e.g. empty or living in a batch path's live batch). `masked` is its masked
    prefix; `written` becomes true at the first forward."""

    def __init__(self, masked=0, cache=None, written=False):
        self.masked = masked
        self.cache = cache
        self.written = written


# --- paths ----------------------------------------------------------------------------------


class PathBase:
    """What every path shares: sequence bookkeeping, request checks, stats."""

    name = "?"
    masked_prefix = False

    def __init__(self, mx, model, vocab, args):
        self.mx = mx
        self.model = model
        self.vocab = vocab
        self.args = args
        self.reset()

    def reset(self):
        self.seqs = {}
        self.next_id = 0
        self.peak = 0
        self.counts = {"forwards": 0, "max_rows": 0, "tokens": 0, "rows_trimmed": 0, "rows_copied": 0}
        self.mx.clear_cache()

    def count_call(self, rows, tokens):
        """One model call over `rows` sequences of `tokens` tokens in all."""
        self.counts["forwards"] += 1
        self.counts["max_rows"] = max(self.counts["max_rows"], rows)
        self.counts["tokens"] += tokens

    def shape(self):
        margs = self.model.args
        heads = getattr(margs, "num_key_value_heads", None) or margs.num_attention_heads
        head_dim = getattr(margs, "head_dim", None) or margs.hidden_size // margs.num_attention_heads
        return len(self.model.layers), heads, head_dim

    def value_bytes(self):
        from mlx.utils import tree_flatten

        for _, value in tree_flatten(self.model.parameters()):
            if self.mx.issubdtype(value.dtype, self.mx.floating):
                return value.dtype.size
        return 4

    def declared_row_bytes(self):
        """K and V of one row over all layers, as the layout promises: the compute dtype."""
        layers, heads, head_dim = self.shape()
        return 2 * layers * heads * head_dim * self.value_bytes()

    def seq(self, seq_id):
        if not isinstance(seq_id, int) or seq_id not in self.seqs:
            raise RequestError(f"no sequence {seq_id!r} (live: {sorted(self.seqs)})")
        return self.seqs[seq_id]

    def add(self, seq):
        seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = seq
        return seq_id

    def create(self, masked):
        if not isinstance(masked, int) or masked < 0:
            raise RequestError(f"masked_prefix must be a non-negative integer, got {masked!r}")
        if masked and not self.masked_prefix:
            raise Unsupported(
                f"{self.name} holds one unpadded sequence: it has no masked (left-padded) prefix"
            )
        return self.add(Seq(masked=masked))

    def trim_caches(self, cache, n, what):
        """mlx-lm's trim_prompt_cache on one cache list; returns what it removed."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if not can_trim_prompt_cache(cache):
            raise RequestError(
                f"{what}: mlx-lm cannot trim this cache (can_trim_prompt_cache is false: "
                f"{untrimmable(cache)}.is_trimmable() returned False)"
            )
        return trim_prompt_cache(cache, n)

    def cut_copy(self, cache, have, rows):
        """Cut a copy of a donor's caches (`have` rows) to its first `rows` with mlx-lm's
        trim_prompt_cache, as LRUPromptCache.fetch_nearest_cache does; a copy mlx-lm cannot
        trim cannot be cut: unsupported."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if cache is None or rows == have:
            return
        if not can_trim_prompt_cache(cache):
            raise Unsupported(
                f"{untrimmable(cache)} cannot be trimmed here (is_trimmable() is false), "
                "so a copy of the donor cannot be cut to the shared prefix"
            )
        removed = trim_prompt_cache(cache, have - rows)
        if removed != have - rows:
            raise RequestError(f"share_prefix: mlx-lm's trim of the copy removed {removed} of {have - rows} rows")

    def note_peak(self):
        self.peak = max(self.peak, self.bytes_in_use())

    def stats(self):
        in_use = self.bytes_in_use()
        self.peak = max(self.peak, in_use)
        return {
            "bytes_live": int(self.bytes_live()),
            "bytes_in_use": int(in_use),
            "bytes_reserved": int(in_use),
            "peak_bytes_in_use": int(self.peak),
            "blocks_in_use": 0,
            "peak_blocks_in_use": 0,
            "blocks_reserved": 0,
            "counters": dict(self.counts),
        }


class PerSequencePath(PathBase):
    """kv, quantized and rotating: one mlx-lm cache per sequence per layer, rows run one by one."""

    def make_cache(self):
        raise NotImplementedError

    def length(self, seq, what="sequence"):
        if seq.cache is None:
            return 0
        return one_offset([c.offset for c in seq.cache], what)

    def forward(self, rows):
        ids = [row.seq for row in rows]
        out = []
        for row in rows:
            seq = self.seqs[row.seq]
            if seq.cache is None:
                seq.cache = self.make_cache()
            tokens = self.mx.array([row.tokens], dtype=self.mx.uint32)
            logits = self.model(tokens, cache=seq.cache)[0, row.logits_at]
            self.count_call(1, len(row.tokens))
            self.mx.eval(logits, [c.state for c in seq.cache])
            seq.written = True
            out.append(logits)
        self.note_peak()
        lengths = [self.length(self.seqs[i], f"sequence {i}") for i in ids]
        return self.mx.stack(out), lengths

    def trim(self, seq_id, n):
        seq = self.seq(seq_id)
        if seq.cache is None:
            return 0, 0
        removed = self.trim_caches(seq.cache, n, f"sequence {seq_id}")
        self.counts["rows_trimmed"] += int(removed)
        return removed, self.length(seq, f"sequence {seq_id}")

    def release(self, seq_id):
        self.seq(seq_id)
        del self.seqs[seq_id]

    def share_prefix(self, donor_id, rows):
        donor = self.seq(donor_id)
        have = self.length(donor)
        if not isinstance(rows, int) or not 0 <= rows <= have:
            raise RequestError(f"sequence {donor_id} has {have} rows, cannot share {rows!r}")
        cache = copy.deepcopy(donor.cache) if donor.cache is not None else None
        self.cut_copy(cache, have, rows)
        new_id = self.add(Seq(cache=cache, written=donor.written))
        self.counts["rows_copied"] += rows
        self.note_peak()
        return new_id, "copy"

    def caches(self):
        return [seq.cache for seq in self.seqs.values() if seq.cache is not None]

    def bytes_in_use(self):
        return sum(c.nbytes for cache in self.caches() for c in cache)

    def bytes_live(self):
        return sum(c.offset * row_bytes(c) for cache in self.caches() for c in cache)


class KVCaches:
    """A sequence's caches: KVCache on every layer, whatever the model's make_cache builds. A
    sliding-window model then keeps every row and its mask applies the window
    (create_attention_mask's window_size): the reference its windowed caches are compared with."""

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.model.layers]


class ModelCaches:
    """A sequence's caches as mlx-lm builds them for the model (make_prompt_cache, which defers to
    the model's make_cache): for Gemma 3, RotatingKVCache(max_size=sliding_window) on the sliding
    layers and KVCache on the global ones; for models without make_cache, KVCache."""

    def make_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)


class KVPath(KVCaches, PerSequencePath):
    name = "KVCache"


class ModelCachePath(ModelCaches, PerSequencePath):
    """One set of the model's caches per sequence: what mlx-lm's generate runs."""

    name = "model"


class QuantizedPath(PerSequencePath):
    name = "QuantizedKVCache"

    def create(self, masked):
        margs = self.model.args
        head_dim = getattr(margs, "head_dim", None) or margs.hidden_size // margs.num_attention_heads
        if head_dim % self.args.group_size:
            raise Unsupported(
                f"QuantizedKVCache(group_size={self.args.group_size}) cannot hold head_dim {head_dim}: "
                "mx.quantize groups the last dimension, which must be a multiple of the group size"
            )
        return super().create(masked)

    def declared_row_bytes(self):
        """mx.quantize's layout: `bits` per element packed, and a scale and a bias (the compute
        dtype) per group of `group_size`, for K and for V."""
        layers, heads, head_dim = self.shape()
        groups = head_dim // self.args.group_size
        per_head = head_dim * self.args.bits // 8 + 2 * groups * self.value_bytes()
        return 2 * layers * heads * per_head

    def make_cache(self):
        from mlx_lm.models.cache import QuantizedKVCache

        return [
            QuantizedKVCache(group_size=self.args.group_size, bits=self.args.bits)
            for _ in self.model.layers
        ]


class RotatingPath(PerSequencePath):
    name = "RotatingKVCache"

    def make_cache(self):
        from mlx_lm.models.cache import RotatingKVCache

        return [RotatingKVCache(max_size=self.args.max_size, keep=4) for _ in self.model.layers]


class BatchPath(KVCaches, PathBase):
    """mlx-lm's batch caches composed like its BatchGenerator (see the module docstring). A
    sequence outside the live batch holds its own caches (make_cache's); _merge_caches turns
    them into the batch classes (each cache class's merge: KVCache.merge is BatchKVCache.merge,
    RotatingKVCache.merge is BatchRotatingKVCache.merge) and each batch cache's extract turns a
    row back into one of its own. Here: BatchKVCache on every layer."""

    name = "BatchKVCache"
    masked_prefix = True

    def reset(self):
        super().reset()
        self.batch = None  # one batch cache per layer (_merge_caches'), or None
        self.batch_ids = []  # sequence id of each batch row

    # -- composition --

    def row_offset(self, row, what):
        return one_offset([int(c.offset[row].item()) for c in self.batch], what)

    def length(self, seq_id):
        seq = self.seqs[seq_id]
        what = f"sequence {seq_id}"
        if seq_id in self.batch_ids:
            real = self.row_offset(self.batch_ids.index(seq_id), what)
        elif seq.cache is not None:
            real = one_offset([c.offset for c in seq.cache], what)
        else:
            real = 0
        return real + seq.masked if seq.written else real

    def drop_rows(self, leaving, keep_caches):
        """Take rows out of the live batch: extract their caches first if asked (as
        BatchGenerator.remove(return_prompt_caches=True) does), then filter."""
        if not leaving:
            return
        if keep_caches:
            for seq_id in leaving:
                row = self.batch_ids.index(seq_id)
                self.seqs[seq_id].cache = [c.extract(row) for c in self.batch]
        keep = [r for r, s in enumerate(self.batch_ids) if s not in leaving]
        self.batch_ids = [self.batch_ids[r] for r in keep]
        if not keep:
            self.batch = None  # as PromptProcessingBatch.filter: an empty batch is dropped
            return
        for c in self.batch:
            c.filter(keep)

    def joining_batches(self, joining):
        """Batch caches for sequences joining the live batch, merged from their own caches by
        mlx-lm's _merge_caches (PromptProcessingBatch's): those with rows (or no masked prefix)
        in one group; not-yet-written sequences with a masked prefix in a second group, merged
        from fresh caches (empty batch caches) and given their left padding via prepare()."""
        from mlx_lm.generate import _merge_caches

        plain = [i for i in joining if self.seqs[i].written or not self.seqs[i].masked]
        padded = [i for i in joining if i not in plain]
        groups = []
        if plain:
            groups.append((plain, _merge_caches([self.seqs[i].cache or self.make_cache() for i in plain])))
        if padded:
            batch = _merge_caches([self.make_cache() for _ in padded])
            for c in batch:
                c.prepare(left_padding=[self.seqs[i].masked for i in padded])
            groups.append((padded, batch))
        for ids, _ in groups:
            for i in ids:
                self.seqs[i].cache = None
        return groups

    def compose(self, ids):
        """Make the live batch hold exactly the sequences `ids` (in any row order)."""
        if set(ids) == set(self.batch_ids):
            return
        self.drop_rows([s for s in self.batch_ids if s not in ids], keep_caches=True)
        for group_ids, group in self.joining_batches([i for i in ids if i not in self.batch_ids]):
            if self.batch is None:
                self.batch = group
            else:
                for c, other in zip(self.batch, group):
                    c.extend(other)
            self.batch_ids += group_ids

    # -- operations --

    def forward(self, rows):
        ids = [row.seq for row in rows]
        for row in rows:
            seq = self.seqs[row.seq]
            if not seq.written and seq.masked and row.logits_at < seq.masked:
                raise RequestError(
                    f"sequence {row.seq}: logits_at {row.logits_at} points into its masked prefix of {seq.masked}"
                )
        self.compose(ids)
        by_seq = {row.seq: row for row in rows}
        tokens = self.mx.array([by_seq[s].tokens for s in self.batch_ids], dtype=self.mx.uint32)
        logits = self.model(tokens, cache=self.batch)
        self.count_call(len(self.batch_ids), tokens.size)
        order = self.mx.array([self.batch_ids.index(s) for s in ids])
        at = self.mx.array([by_seq[s].logits_at for s in ids])
        picked = logits[order, at]
        self.mx.eval(picked, [c.state for c in self.batch])
        for seq_id in ids:
            self.seqs[seq_id].written = True
        self.note_peak()
        return picked, [self.length(i) for i in ids]

    def trim(self, seq_id, n):
        seq = self.seq(seq_id)
        have = self.length(seq_id)
        real = have - (seq.masked if seq.written else 0)
        if n > real:
            raise RequestError(
                f"sequence {seq_id} has {real} rows after its masked prefix of {seq.masked}, cannot trim {n}"
            )
        what = f"sequence {seq_id}"
        if self.batch_ids == [seq_id]:
            removed = self.trim_caches(self.batch, n, what)  # the batch caches' own trim
        else:
            self.drop_rows([seq_id] if seq_id in self.batch_ids else [], keep_caches=True)
            removed = self.trim_caches(seq.cache, n, what) if seq.cache is not None else 0
        self.counts["rows_trimmed"] += int(removed)
        return removed, self.length(seq_id)

    def release(self, seq_id):
        self.seq(seq_id)
        self.drop_rows([seq_id] if seq_id in self.batch_ids else [], keep_caches=False)
        del self.seqs[seq_id]

    def share_prefix(self, donor_id, rows):
        donor = self.seq(donor_id)
        have = self.length(donor_id)
        masked = donor.masked if donor.written else 0
        if not isinstance(rows, int) or not 0 <= rows <= have:
            raise RequestError(f"sequence {donor_id} has {have} rows, cannot share {rows!r}")
        if rows < masked:
            raise Unsupported(
                f"the shared prefix ({rows} rows) ends inside sequence {donor_id}'s masked prefix "
                f"of {masked}; the batch caches' extract keeps only real rows"
            )
        if donor_id in self.batch_ids:
            row = self.batch_ids.index(donor_id)
            cache = [c.extract(row) for c in self.batch]
        else:
            cache = copy.deepcopy(donor.cache)
        self.cut_copy(cache, have, rows)
        new_id = self.add(Seq(masked=masked, cache=cache, written=donor.written))
        self.counts["rows_copied"] += rows
        self.note_peak()
        return new_id, "copy"

    # -- memory --

    def own_caches(self):
        return [seq.cache for seq in self.seqs.values() if seq.cache is not None]

    def bytes_in_use(self):
        total = sum(c.nbytes for cache in self.own_caches() for c in cache)
        return total + (sum(c.nbytes for c in self.batch) if self.batch else 0)

    def bytes_live(self):
        total = sum(c.offset * row_bytes(c) for cache in self.own_caches() for c in cache)
        if self.batch:
            rows = sum(self.length(i) for i in self.batch_ids)
            total += sum(rows * row_bytes(c) for c in self.batch)
        return total


class BatchModelPath(ModelCaches, BatchPath):
    """What mlx-lm's BatchGenerator builds for the model: make_prompt_cache per sequence
    (insert_segments), merged by _merge_caches: for Gemma 3, BatchRotatingKVCache(max_size=
    sliding_window) on the sliding layers and BatchKVCache on the global ones."""

    name = "batch-model"


PATHS = {
    "kv": KVPath,
    "model": ModelCachePath,
    "batch": BatchPath,
    "batch-model": BatchModelPath,
    "quantized": QuantizedPath,
    "rotating": RotatingPath,
}


# --- the engine, as the adapter kit serves it ----------------------------------------------


class MlxLmEngine(Engine):
    """One path (`--cache`) of mlx-lm, its model loaded at start or from hello."""

    name = "mlx-lm"

    def __init__(self, args):
        import mlx.core as mx
        import mlx_lm

        self.mx = mx
        self.args = args
        self.version = mlx_lm.__version__
        self.path = None
        self.device = pick_device(mx)
        if args.model:
            self.load_model(args.model)

    def load_model(self, directory):
        model, _, vocab = load_model(self.mx, directory, self.args.dtype, self.args.dequantize)
        self.dtype = compute_dtype_name(self.mx, model)
        self.path = PATHS[self.args.cache](self.mx, model, vocab, self.args)
        print(
            f"[mlx-lm adapter] {directory}: {self.path.name}, {self.dtype}"
            f"{', dequantized' if self.args.dequantize else ''}, vocab {vocab}",
            file=sys.stderr,
        )

    def load(self, model, path, settings):
        if self.path is None:
            if not model:
                raise RequestError("hello has no model and the adapter was started without --model")
            self.load_model(model)

    def describe(self):
        p = self.path
        caps = capabilities(
            masked_prefix=p.masked_prefix, share_prefix=True, stats=True, kv_row_bytes=p.declared_row_bytes()
        )
        return {"vocab_size": p.vocab, "dtype": self.dtype, "capabilities": caps}

    def reset(self):
        self.path.reset()

    def create(self, masked_prefix):
        return self.path.create(masked_prefix)

    def forward(self, rows):
        return self.path.forward(rows)

    def trim(self, seq, n):
        return self.path.trim(seq, n)

    def release(self, seq):
        self.path.release(seq)

    def share_prefix(self, donor, rows):
        return self.path.share_prefix(donor, rows)

    def stats(self):
        return self.path.stats()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the one named in hello)")
    p.add_argument("--cache", choices=sorted(PATHS), required=True, help="the path to serve")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="compute dtype")
    p.add_argument("--dequantize", action="store_true", help="dequantize quantized layers at load")
    p.add_argument("--bits", type=int, default=8, help="QuantizedKVCache bits (quantized)")
    p.add_argument("--group-size", type=int, default=64, help="QuantizedKVCache group size (quantized)")
    p.add_argument("--max-size", type=int, help="RotatingKVCache window (rotating, required)")
    args = p.parse_args(argv)
    if args.cache == "rotating" and (args.max_size is None or args.max_size < 1):
        p.error("--cache rotating needs --max-size N (N >= 1)")
    return args


def main(argv=None):
    args = parse_args(argv)
    # Before anything loads: stdout carries protocol lines only.
    from parity_adapter import protocol_stdout

    out = protocol_stdout()
    try:
        engine = MlxLmEngine(args)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        sys.exit(f"[mlx-lm adapter] cannot start: {e}")
    serve(engine, out=out)


if __name__ == "__main__":
    main()
