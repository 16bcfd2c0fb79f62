"""mlx-lm 0.32.2: BatchRotatingKVCache hides a real key from a multi-token forward made after
its buffer has rotated, on a row with left padding. The mask comes from make_mask, which the
model calls before update_and_fetch (Gemma3Model.__call__: create_attention_mask(h, cache[0],
window_size=...)); make_mask predicts the front trim _update_concat will make from `_idx`
(`trim_size = self._idx - self.max_size + int(N > 1)`), but once the buffer has rotated `_idx` is
the ring's write position, and _update_concat first puts the buffer in temporal order
(_temporal_order: `_idx = keys.shape[2]`, the window) and trims from that. make_mask then
shifts left_padding by one less than _update_concat does, and the oldest real key of a row
that still has left padding is masked as padding. Found by `parity explore suites/gemma3.toml
--backend batch-model` (adapters/mlx_lm_adapter.py, the caches mlx-lm's BatchGenerator builds
for Gemma 3; docs/results.md). BatchGenerator itself never makes such a forward (it decodes
one token a step); a caller that verifies a draft or continues a prompt in a running batch does.

    ci/mlx-lm ci/repro/mlx_lm_batch_rotating_mask.py

Attention only (no model, no RoPE): one sequence with 2 left pads in a window of 4. Rows
r0, r1 are prefilled behind the pads, r2 is decoded (the buffer rotates), then n0, n1 come in
one forward. Each step's attention output is compared with the same real rows in a KVCache under
the window mask (KVCache.make_mask, i.e. create_causal_mask(N, offset, window_size)). Exit
status 1 when mlx-lm's output differs (the bug reproduced), 0 when it agrees.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache

WINDOW, PADS, HEADS, DIM = 4, 2, 1, 8


def rows(n, seed):
    return mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed))


def attend(cache, q, k, v):
    # The mask before the update, as the model builds it.
    mask = cache.make_mask(q.shape[2], window_size=WINDOW, return_array=True)
    keys, values = cache.update_and_fetch(k, v)
    return mask, mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)


def masked_as_padding(mask, n):
    """Leading key columns no real query (the last n rows) may see."""
    visible = mx.broadcast_to(mask, (1, 1, n, mask.shape[-1]))[0, 0, -n:].tolist()
    seen = [any(r[j] for r in visible) for j in range(len(visible[0]))]
    return seen.index(True)


def main():
    batch = BatchRotatingKVCache(max_size=WINDOW, left_padding=[PADS])  # as merge + prepare give
    full = KVCache()
    steps = [("prefill r0, r1 behind 2 pads", 2), ("decode r2 (the buffer rotates)", 1), ("forward n0, n1", 2)]
    worst = 0.0
    for i, (what, n) in enumerate(steps):
        q, k, v = rows(n, 3 * i), rows(n, 3 * i + 1), rows(n, 3 * i + 2)
        if i == 0:  # the pads: written like any row, masked by left_padding
            q, k, v = (mx.concatenate([mx.zeros((1, HEADS, PADS, DIM)), x], axis=2) for x in (q, k, v))
        rotated = batch.rotated
        mask, got = attend(batch, q, k, v)
        _, want = attend(full, q[:, :, -n:], k[:, :, -n:], v[:, :, -n:])
        diff = mx.abs(got[:, :, -n:] - want).max().item()
        worst = max(worst, diff)
        line = f"{what}: rotated before={rotated}, after={batch.rotated}; max |BatchRotatingKVCache - KVCache| = {diff:.3g}"
        if n > 1 and i > 0:
            line += (f"; make_mask masked {masked_as_padding(mask, n)} leading key column(s) as padding, "
                     f"update_and_fetch left {batch.left_padding.tolist()[0]} pad row(s) in front of the keys")
        print(line)
    if worst > 1e-5:
        print("REPRODUCED: the multi-token forward after rotation masks the oldest real key "
              "(n0 attends to r1, r2, n0 only; its window is r0, r1, r2, n0)")
        return 1
    print("not reproduced: BatchRotatingKVCache agrees with KVCache under the window mask")
    return 0


if __name__ == "__main__":
    sys.exit(main())
