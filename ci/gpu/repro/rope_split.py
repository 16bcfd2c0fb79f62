#!/usr/bin/env python3
"""mx.fast.rope on the GPU against the same call on the CPU, over the input layouts that occur.

The layout that fails is parity's: q/k/v computed by ONE stacked projection and cut apart with
`mx.split` (parity's `Stacked::forward` -> `split_at_indices`), then reshaped to
`[B, T, H, D]` and transposed to `[B, H, T, D]`. The same values in the same strides cut with a
slice (`y[..., :H*D]`) pass, and so does mlx-lm's layout (a projection of its own, then
reshape + transpose). Why (MLX 0.32.2 source):

- `Split::eval` (mlx/backend/common/common.cpp) gives each output a `data_size` of its element
  count (B*T*H*D), not the span its strides reach ((B*T-1)*Q + H*D, Q the stacked width), which
  `array::data_size()`'s own documentation defines it as and `slice` computes.
- `RoPE::eval_gpu` (mlx/backend/cuda/rope.cu), for an input it cannot donate, allocates the output
  as `in.data_size()` elements but gives it `in.strides()`, and the kernel writes through those
  strides: past the end of the allocation whenever B*T > 1.

Layouts (each with and without `freqs`, scalar and `[B]` array offsets):
  contiguous   a fresh [B, H, T, D] array
  transposed   [B, T, H, D] -> transpose (mlx-lm: own projection, reshape, transpose)
  split-q      mx.split of a stacked [B, T, (H+2K)*D] -> q piece -> reshape -> transpose (parity)
  split-k      the same, the k piece (a view that starts H*D into each row)
  slice-q      the same strides from a slice y[..., :H*D] instead of mx.split
  split-q-contig  mx.split, then mx.contiguous on the piece before reshape (a workaround)

Usage:
  python3 rope_split.py                       # every case; exit 1 if any GPU result differs
  python3 rope_split.py --case split-q/freqs/array/B2T7/llama-tiny   # one case (for compute-sanitizer)
  python3 rope_split.py --list
  python3 rope_split.py --json out.json
  python3 rope_split.py --isolate --filter split-   # each case in a fresh process (no buffer
                                                    # recycled from an earlier case)
Exit 77 with "SKIP(no-gpu)" when MLX has no GPU (unless --allow-cpu, which compares the CPU with
itself: a plumbing check).
"""

import argparse
import json
import math
import sys
import time

import mlx.core as mx

# float32. Where the layouts agree, GPU and CPU differ by at most 1.04e-5 (positions up to 39:
# cos/sin of angles up to ~40 rad, |x| up to ~4.3), measured on the H200 (docs/gpu.md); a broken
# layout is off by O(1). The first run used 1e-5, which flagged that rounding as DIFF.
TOL = 1e-4

# (name, heads, kv_heads, head_dim, base, llama3 scaling or None)
MODELS = {
    # fixtures/llama-tiny.toml: 4 heads over 2 KV heads, head_dim 16, Llama 3 scaling
    "llama-tiny": (4, 2, 16, 500000.0, dict(factor=8.0, low=1.0, high=4.0, old_ctx=64.0)),
    # SmolLM2-135M: 9 heads over 3, head_dim 64, theta 1e5, no scaling
    "smollm2": (9, 3, 64, 100000.0, None),
}


def llama3_periods(head_dim, base, factor, low, high, old_ctx):
    """parity's src/model/rope.rs llama3_periods (and mlx-lm's Llama3RoPE): periods, not inverse."""
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        period = base ** (i / head_dim)
        wavelen = 2 * math.pi * period
        if wavelen > low_wavelen:
            out.append(period * factor)
        elif high_wavelen < wavelen < low_wavelen:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(period / ((1 - smooth) / factor + smooth))
        else:
            out.append(period)
    return out


def cases():
    out = []
    for model in MODELS:
        shapes = [(1, 1), (1, 7), (2, 1), (2, 7)] if model == "llama-tiny" else [(1, 1), (1, 37), (2, 1)]
        for layout in ["contiguous", "transposed", "split-q", "split-k", "slice-q", "split-q-contig"]:
            for freqs in ["base", "freqs"]:
                if freqs == "freqs" and MODELS[model][4] is None and layout not in ("split-q", "slice-q"):
                    continue  # SmolLM2 has no scaling: freqs only to cross-check the two layouts
                for off in ["scalar", "array"]:
                    for b, t in shapes:
                        out.append(f"{layout}/{freqs}/{off}/B{b}T{t}/{model}")
    return out


def build(case, stream):
    """The rope input for `case` built on `stream` from the same host data, and rope's args."""
    layout, freqs_kind, off_kind, bt, model = case.split("/")
    b, t = (int(x) for x in bt[1:].split("T"))
    h, k, d, base, scaling = MODELS[model]
    q_width = (h + 2 * k) * d
    key = mx.random.key(7)
    with mx.stream(mx.cpu):
        host = mx.random.normal((b, t, q_width), key=key)  # the stacked projection's output
        mx.eval(host)
    with mx.stream(stream):
        y = mx.array(host)  # a copy owned by this stream's device
        y = y + 0  # an op on `stream`, as a projection's output would be
        heads = k if layout == "split-k" else h
        if layout == "contiguous":
            x = mx.contiguous(y[..., : h * d].reshape(b, t, h, d).transpose(0, 2, 1, 3))
        elif layout == "transposed":
            x = mx.contiguous(y[..., : h * d]).reshape(b, t, h, d).transpose(0, 2, 1, 3)
        elif layout in ("split-q", "split-k", "split-q-contig"):
            q, kk, v = mx.split(y, [h * d, (h + k) * d], axis=-1)
            piece = kk if layout == "split-k" else q
            if layout == "split-q-contig":
                piece = mx.contiguous(piece)
            x = piece.reshape(b, t, heads, d).transpose(0, 2, 1, 3)
        elif layout == "slice-q":
            x = y[..., : h * d].reshape(b, t, h, d).transpose(0, 2, 1, 3)
        else:
            raise ValueError(layout)
        offsets = [3, 0][:b] if b > 1 else [3]
        offset = mx.array(offsets, dtype=mx.int32) if off_kind == "array" else 3
        if off_kind == "scalar" and b > 1:
            offset = 3
        if freqs_kind == "freqs":
            sc = scaling or dict(factor=1.0, low=1.0, high=4.0, old_ctx=8192.0)
            freqs = mx.array(llama3_periods(d, base, sc["factor"], sc["low"], sc["high"], sc["old_ctx"]), dtype=mx.float32)
            kw = dict(base=None, freqs=freqs)
        else:
            kw = dict(base=base)
        out = mx.fast.rope(x, d, traditional=False, scale=1.0, offset=offset, **kw)
        # What consumes rope's output in parity: an elementwise op (here +0) that reads it
        # through its strides, then the values on the host.
        out = out + 0
        mx.eval(out)
    with mx.stream(mx.cpu):
        host_out = mx.array(out)
        mx.eval(host_out)
    return host_out


def run_case(case, gpu):
    t0 = time.time()
    ref = build(case, mx.cpu)
    got = build(case, gpu)
    diff = mx.abs(ref - got)
    max_abs = diff.max().item()
    scale = mx.abs(ref).max().item()
    bad = int((diff > TOL).sum().item())
    return {
        "case": case,
        "max_abs_diff": max_abs,
        "ref_max_abs": scale,
        "elements": ref.size,
        "elements_off": bad,
        "nan": bool(mx.isnan(got).any().item()),
        "ok": bool(max_abs <= TOL and not math.isnan(max_abs)),
        "seconds": round(time.time() - t0, 3),
    }


def run_isolated(case, allow_cpu):
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--json", out]
        if allow_cpu:
            cmd.append("--allow-cpu")
        p = subprocess.run(cmd, capture_output=True, text=True)
        if os.path.exists(out):
            return json.load(open(out))["results"][0]
        return {"case": case, "ok": False, "error": f"exit {p.returncode}: {(p.stdout + p.stderr)[-300:]}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="run only these cases (repeatable)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--allow-cpu", action="store_true", help="no GPU: compare the CPU with itself")
    ap.add_argument("--filter", action="append", help="only cases containing this text (repeatable: any)")
    ap.add_argument("--isolate", action="store_true", help="run each case in its own process")
    a = ap.parse_args()
    if a.list:
        print("\n".join(cases()))
        return 0
    gpu = mx.gpu
    if not mx.cuda.is_available() and not mx.metal.is_available():
        if not a.allow_cpu:
            print("SKIP(no-gpu): MLX sees no GPU (mx.cuda.is_available() and mx.metal.is_available() are False)")
            return 77
        gpu = mx.cpu
    print(f"mlx {mx.__version__}; comparing {gpu} with {mx.cpu}; tolerance {TOL:g}", flush=True)
    selected = a.case or cases()
    if a.filter:
        selected = [c for c in selected if any(f in c for f in a.filter)]
    results = []
    for case in selected:
        if a.isolate:
            r = run_isolated(case, a.allow_cpu)
        else:
            try:
                r = run_case(case, gpu)
            except Exception as e:  # a device error is a result too
                r = {"case": case, "ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        if "error" in r:
            print(f"ERROR {case}: {r['error']}", flush=True)
        else:
            print(
                f"{'ok  ' if r['ok'] else 'DIFF'} {case:44s} max|gpu-cpu| {r['max_abs_diff']:.3g} "
                f"(|ref| {r['ref_max_abs']:.3g}; {r['elements_off']}/{r['elements']} elements off)",
                flush=True,
            )
    failed = [r["case"] for r in results if not r["ok"]]
    # The verdict by layout: which layouts fail anywhere.
    by_layout = {}
    for r in results:
        by_layout.setdefault(r["case"].split("/")[0], []).append(r["ok"])
    print("by layout: " + ", ".join(f"{k} {sum(v)}/{len(v)} ok" for k, v in by_layout.items()))
    print(f"{len(results) - len(failed)}/{len(results)} cases agree with the CPU")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mlx": mx.__version__, "device": str(gpu), "tolerance": TOL, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
