#!/usr/bin/env python3
"""float32 matmul on MLX's CUDA backend: TF32 by default, and a row's result depends on the batch.

MLX 0.32.2 runs float32 GEMMs on CUDA with CUBLAS_COMPUTE_32F_FAST_TF32 unless
MLX_ENABLE_TF32=0 (mlx/utils.h `enable_tf32`, default 1; mlx/backend/cuda/gemms/cublas_gemm.cpp).
TF32 keeps 10 mantissa bits, so a row computed alone (M = 1) and the same row inside a batch
(M = 2, another kernel, another accumulation) differ by ~1e-3 relative, where parity's fixture
tolerance is 1e-3: what makes gemma3-tiny's batched rows fail on the GPU with identical tokens.

For each setting of MLX_ENABLE_TF32 (a fresh process each, since MLX reads it once) this prints:
  vs-cpu      relative RMS of the GPU's x @ W against the CPU's
  batch-dep   relative RMS between row 0 of (x[:1] @ W) and row 0 of (x[:2] @ W), both on the GPU
Usage: python3 tf32_batch.py [--json out.json]; exit 77 "SKIP(no-gpu)" without a GPU.
"""

import json
import os
import subprocess
import sys


def measure():
    import mlx.core as mx

    if not mx.cuda.is_available():
        print(json.dumps({"skip": True}))
        return
    out = {}
    for k, n in [(64, 128), (576, 1536)]:  # gemma3-tiny-ish and SmolLM2's hidden -> MLP widths
        with mx.stream(mx.cpu):
            x = mx.random.normal((8, k), key=mx.random.key(1))
            w = mx.random.normal((k, n), key=mx.random.key(2)) / k**0.5
            ref = x @ w
            mx.eval(ref)
        with mx.stream(mx.gpu):
            full = x @ w
            one = x[:1] @ w
            two = x[:2] @ w
            mx.eval(full, one, two)

        def rel(a, b):
            a, b = mx.array(a, dtype=mx.float32), mx.array(b, dtype=mx.float32)
            return (mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(b**2))).item()

        with mx.stream(mx.cpu):
            out[f"{k}x{n}"] = {"vs_cpu": rel(full, ref), "batch_dep": rel(one[0], two[0]),
                               "bitwise_batch_invariant": bool(mx.array_equal(one[0], two[0]).item())}
    print(json.dumps(out))


def main():
    if "--child" in sys.argv:
        measure()
        return 0
    res = {}
    for tf32 in ["default", "0", "1"]:
        env = dict(os.environ)
        env.pop("MLX_ENABLE_TF32", None)
        if tf32 != "default":
            env["MLX_ENABLE_TF32"] = tf32
        p = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception:
            print(f"MLX_ENABLE_TF32={tf32}: child failed: {(p.stdout + p.stderr)[-400:]}")
            return 1
        if r.get("skip"):
            print("SKIP(no-gpu): mx.cuda.is_available() is False")
            return 77
        res[tf32] = r
        for shape, m in r.items():
            print(f"MLX_ENABLE_TF32={tf32:7s} {shape:9s} vs-cpu rel RMS {m['vs_cpu']:.3g}  "
                  f"batch-dep rel RMS {m['batch_dep']:.3g}  row bitwise batch-invariant: {m['bitwise_batch_invariant']}")
    if "--json" in sys.argv:
        json.dump(res, open(sys.argv[sys.argv.index("--json") + 1], "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
