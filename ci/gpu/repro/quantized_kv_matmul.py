#!/usr/bin/env python3
"""MLX's quantized_matmul on CUDA, in the call shape mlx-lm's QuantizedKVCache attention makes.

mlx-lm's `quantized_scaled_dot_product_attention` (mlx_lm/models/base.py) multiplies the
queries [B, H, L, D] by the quantized keys (transpose=True, quantized along D) with
`mx.quantized_matmul`, then the scores by the quantized values. On MLX 0.32.2's CUDA backend
every row of parity's mlx-lm suite on that cache failed in the first prefill with
`[quantized_matmul] No implementation for problem shape: LxLxDxH, transpose: true,
activation: float32, bits: 8, group size: G`. This calls the same operation in three call
shapes (see `scores`: direct 4-D, mlx-lm's grouped-query 5-D shapes, and mlx-lm's function
itself where mlx_lm imports), for each query length L (1 is the decode step, more a prefill),
activation dtype, bits and group size, on the GPU and on the CPU, and prints which raise and,
where both answer, how far the GPU's result is from the CPU's and how far each is from the
same product over its own dequantized keys (relative RMS).

Usage: python3 quantized_kv_matmul.py [--quick | --float32 | --linear] [--json out.json]; exit 77 "SKIP(no-gpu)" without a GPU.
"""

import itertools
import json
import sys

import mlx.core as mx


def rel_rms(a, b):
    d = a.astype(mx.float32) - b.astype(mx.float32)
    b = b.astype(mx.float32)
    return float(mx.sqrt(mx.mean(d * d)) / mx.sqrt(mx.mean(b * b)))


def scores(shape, L, dtype, bits, group, device, keys=16, dim=64):
    """The queries-against-quantized-keys product, on `device`, in one of three call shapes:

    2d       queries [L, D] against keys [S, D] (D = 64)
    3d       queries [H, L, D] against keys [H, S, D] (H = 4)
    direct   queries [1, H, L, D] against keys [1, H, S, D]
    gqa      mlx-lm's own shapes for grouped attention (base.py): SmolLM2's 9 query heads over
             3 KV heads, queries reshaped to [1, 3, 3, L, 64], each quantized key array given
             an axis at -3 (expand_dims), then the values multiplied the same way
    mlx-lm   mlx_lm.models.base.quantized_scaled_dot_product_attention itself (where mlx_lm
             imports), SmolLM2's heads, causal mask

    `keys` is S, the cached rows: the N of the product, the quantized operand's row count.
    Returns (result, the same product computed from the dequantized keys on the same device),
    so a wrong kernel shows against its own inputs, not only against another device."""
    heads, kv_heads = (9, 3) if shape in ("gqa", "mlx-lm") else (4, 4)
    # 2d and 3d: the direct product without the leading axes (a quantized Linear layer's
    # shapes are 2-D weights against [..., L, D] inputs).
    lead = {"2d": (), "3d": (heads,)}.get(shape, (1, heads))
    kv_lead = {"2d": (), "3d": (kv_heads,)}.get(shape, (1, kv_heads))
    mx.random.seed(0)
    q = mx.random.normal(lead + (L, dim)).astype(dtype)
    k = mx.random.normal(kv_lead + (keys, dim)).astype(dtype)
    v = mx.random.normal(kv_lead + (keys, dim)).astype(dtype)
    with mx.stream(device):
        qk = mx.quantize(k, group_size=group, bits=bits)
        qv = mx.quantize(v, group_size=group, bits=bits)
        kd = mx.dequantize(*qk, group_size=group, bits=bits)
        if shape in ("direct", "2d", "3d"):
            out = mx.quantized_matmul(q, *qk, transpose=True, group_size=group, bits=bits)
            ref = q @ kd.swapaxes(-1, -2)
        elif shape == "gqa":
            rep = heads // kv_heads
            qq = mx.reshape(q, (1, kv_heads, rep, L, dim))
            qk5 = [mx.expand_dims(x, -3) for x in qk]
            qv5 = [mx.expand_dims(x, -3) for x in qv]
            s = mx.quantized_matmul(qq, *qk5, transpose=True, group_size=group, bits=bits)
            p = mx.softmax(s, axis=-1)
            out = mx.quantized_matmul(p, *qv5, transpose=False, group_size=group, bits=bits)
            vd = mx.dequantize(*qv, group_size=group, bits=bits)
            sr = qq @ mx.expand_dims(kd, -3).swapaxes(-1, -2)
            ref = mx.softmax(sr, axis=-1) @ mx.expand_dims(vd, -3)
        else:
            from mlx_lm.models.base import quantized_scaled_dot_product_attention as qsdpa

            # The reference first: qsdpa scales its queries in place (`queries *= scale`).
            vd = mx.dequantize(*qv, group_size=group, bits=bits)
            rep = heads // kv_heads
            mask = "causal" if L > 1 else None
            ref = mx.fast.scaled_dot_product_attention(
                q, mx.repeat(kd, rep, 1), mx.repeat(vd, rep, 1), scale=dim**-0.5, mask=mask
            )
            mx.eval(ref)
            out = qsdpa(q, qk, qv, scale=dim**-0.5, mask=mask, group_size=group, bits=bits)
        mx.eval(out, ref)
    return out, ref


def case(shape, L, dtype, bits, group, keys, dim=64):
    out = {}
    row = {"shape": shape, "L": L, "keys": keys, "dim": dim, "dtype": str(dtype).split(".")[-1], "bits": bits, "group": group}
    for name, device in (("gpu", mx.gpu), ("cpu", mx.cpu)):
        try:
            out[name] = scores(shape, L, dtype, bits, group, device, keys, dim)
            row[name] = "ok"
            row[f"{name}_vs_own_dequantized"] = rel_rms(*out[name])
        except (RuntimeError, ValueError) as e:
            row[name] = str(e).splitlines()[0][:200]
    if row["gpu"] == "ok" and row["cpu"] == "ok":
        row["rel_rms"] = rel_rms(out["gpu"][0], out["cpu"][0])
        # The same call again on the GPU: a kernel reading memory it never wrote answers
        # differently each time.
        again = scores(shape, L, dtype, bits, group, mx.gpu, keys, dim)[0]
        row["gpu_repeat_rel_rms"] = rel_rms(again, out["gpu"][0])
        # Whether the GPU's own reference agrees with the CPU's (so its quantize and
        # dequantize are right), and whether its answer is all zeros (a rel RMS of exactly 1).
        row["reference_rel_rms"] = rel_rms(out["gpu"][1], out["cpu"][1])
        g = out["gpu"][0].astype(mx.float32)
        row["gpu_rms"] = float(mx.sqrt(mx.mean(g * g)))
    return row


def main():
    if not mx.cuda.is_available():
        print("SKIP(no-gpu)")
        sys.exit(77)
    # --quick: the decode step and one prefill, float32, 8 bits group 64 (each new kernel
    # variant is compiled by NVRTC on first use, seconds to tens of seconds each).
    try:
        import mlx_lm.models.base  # noqa: F401

        shapes = ("2d", "3d", "direct", "gqa", "mlx-lm")
    except ImportError:
        shapes = ("2d", "3d", "direct", "gqa")
    if "--linear" in sys.argv:
        # The plainest call, a quantized Linear layer's (2-D weights), by its dimensions:
        # K = dim (the reduced axis), N = keys, M = L.
        for dim, L, bits in itertools.product((64, 128, 256, 576), (1, 7, 37), (4, 8)):
            r = case("2d", L, mx.float32, bits, 64, 128, dim)
            print(f"2d M={L:<3} N=128 K={dim:<4} bits {bits}  gpu {r['gpu']}  vs CPU {r.get('rel_rms', float('nan')):.2e}"
                  f"  vs own dequantized {r.get('gpu_vs_own_dequantized', float('nan')):.2e}"
                  f"  repeat vs first {r.get('gpu_repeat_rel_rms', float('nan')):.2e}", flush=True)
        return
    if "--quick" in sys.argv:
        grid = itertools.product(shapes, (1, 7), (mx.float32,), ((8, 64),), (16, 128))
    else:
        # --float32: every length and bit/group setting, float32 activations only (what
        # parity's mlx-lm suites run).
        dtypes = (mx.float32,) if "--float32" in sys.argv else (mx.float32, mx.bfloat16, mx.float16)
        grid = itertools.product(shapes, (1, 2, 7, 37), dtypes, ((8, 64), (8, 32), (4, 64), (4, 32)), (16, 37, 128))
    rows = []
    for shape, L, dtype, (bits, group), keys in grid:
        r = case(shape, L, dtype, bits, group, keys)
        rows.append(r)
        gpu = r["gpu"] if r["gpu"] == "ok" else "RAISES: " + r["gpu"]
        extra = f"  rel RMS vs CPU {r['rel_rms']:.2e}" if "rel_rms" in r else ""
        if "gpu_rms" in r:
            extra += f" (GPU result RMS {r['gpu_rms']:.2e}; references GPU vs CPU {r['reference_rel_rms']:.2e};"
            extra += f" GPU repeat vs first {r['gpu_repeat_rel_rms']:.2e})"
        for side in ("gpu", "cpu"):
            if f"{side}_vs_own_dequantized" in r:
                extra += f"  {side} vs its own dequantized keys {r[side + '_vs_own_dequantized']:.2e}"
        print(f"{r['shape']:<6} L={r['L']:<3} keys={r['keys']:<3} {r['dtype']:<9} bits {r['bits']} group {r['group']:<3} gpu {gpu}{extra}", flush=True)
    raised = sum(r["gpu"] != "ok" for r in rows)
    print(f"{raised} of {len(rows)} calls raise on the GPU")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
