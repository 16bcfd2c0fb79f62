#!/usr/bin/env python3
"""MLX's quantized_matmul on CUDA, in the call shape mlx-lm's QuantizedKVCache attention makes.

mlx-lm's `quantized_scaled_dot_product_attention` (mlx_lm/models/base.py) multiplies the
queries [B, H, L, D] by the quantized keys (transpose=True, quantized along D) with
`mx.quantized_matmul`, then the scores by the quantized values. On MLX 0.32.2's CUDA backend
every row of parity's mlx-lm suite on that cache failed in the first prefill with
`[quantized_matmul] No implementation for problem shape: LxLxDxH, transpose: true,
activation: float32, bits: 8, group size: G`. This calls the same operation directly, for
each query length L (1 is the decode step, more a prefill), activation dtype, bits and group
size, on the GPU and on the CPU, and prints which raise and, where both answer, how far the
GPU's result is from the CPU's (relative RMS).

Usage: python3 quantized_kv_matmul.py [--quick] [--json out.json]; exit 77 "SKIP(no-gpu)" without a GPU.
"""

import itertools
import json
import sys

import mlx.core as mx


def case(L, dtype, bits, group, heads=4, keys=16, dim=64):
    """One call: queries [1, heads, L, dim] against quantized keys [1, heads, keys, dim]."""
    mx.random.seed(0)
    q = mx.random.normal((1, heads, L, dim)).astype(dtype)
    k = mx.random.normal((1, heads, keys, dim)).astype(dtype)
    out = {}
    for name, device in (("gpu", mx.gpu), ("cpu", mx.cpu)):
        with mx.stream(device):
            try:
                wq, scales, biases = mx.quantize(k, group_size=group, bits=bits)
                s = mx.quantized_matmul(q, wq, scales, biases, transpose=True, group_size=group, bits=bits)
                mx.eval(s)
                out[name] = s.astype(mx.float32)
            except (RuntimeError, ValueError) as e:
                out[name] = str(e).splitlines()[0][:160]
    row = {"L": L, "dtype": str(dtype).split(".")[-1], "bits": bits, "group": group}
    for name in ("gpu", "cpu"):
        row[name] = "ok" if isinstance(out[name], mx.array) else out[name]
    if all(isinstance(out[n], mx.array) for n in ("gpu", "cpu")):
        d = out["gpu"] - out["cpu"]
        row["rel_rms"] = float(mx.sqrt(mx.mean(d * d)) / mx.sqrt(mx.mean(out["cpu"] * out["cpu"])))
    return row


def main():
    if not mx.cuda.is_available():
        print("SKIP(no-gpu)")
        sys.exit(77)
    # --quick: the decode step and one prefill, float32, 8 bits group 64 (each new kernel
    # variant is compiled by NVRTC on first use, seconds to tens of seconds each).
    if "--quick" in sys.argv:
        grid = itertools.product((1, 7), (mx.float32,), ((8, 64),))
    else:
        grid = itertools.product(
            (1, 2, 7, 37), (mx.float32, mx.bfloat16, mx.float16), ((8, 64), (8, 32), (4, 64), (4, 32))
        )
    rows = []
    for L, dtype, (bits, group) in grid:
        r = case(L, dtype, bits, group)
        rows.append(r)
        gpu = r["gpu"] if r["gpu"] == "ok" else "RAISES: " + r["gpu"]
        extra = f"  rel RMS vs CPU {r['rel_rms']:.2e}" if "rel_rms" in r else ""
        print(f"L={r['L']:<3} {r['dtype']:<9} bits {r['bits']} group {r['group']:<3} gpu {gpu}{extra}", flush=True)
    raised = sum(r["gpu"] != "ok" for r in rows)
    print(f"{raised} of {len(rows)} calls raise on the GPU")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
