"""Baseline: mlx-lm's greedy decode speed on a checkpoint, for `parity bench` to print beside
its own numbers. Run it through ci/bench-mlx-lm, which sets up the pinned venv.

Both sides must do the same work for the numbers to mean anything: the same synthetic prompt
ids (`prompt_ids`), the same ragged lengths per batch row (`ragged_lengths`), the same number
of greedy tokens per row. Three measurements:

- `sync` (batch 1): exactly what parity's loop does: one prompt forward pass on a fresh cache,
  then one synchronous forward pass per token (no async_eval pipelining, no chunked prefill).
- `generate_step` (batch 1): mlx-lm's own single-sequence generator, pipelined (step n+1 is
  queued before token n is read).
- `batch_generate` (every batch size in --batch): mlx-lm's batched generator (BatchKVCache,
  left padding, per-row RoPE offsets, pipelined), called with no stop tokens so that every row
  decodes all its tokens, as parity's rows do (a row stopped at EOS would shrink the batch).
  Its own statistics are reported: prompt tok/s over its batched prefill, generation tok/s.

Token convention (shared with parity's engine::generate): the prefill's argmax is the first
greedy token; each of the `--decode` steps feeds the previous token back and yields the next.
So `greedy_tokens` has decode + 1 entries, and a parity run of N tokens should equal its first
N entries.
"""

import argparse
import ctypes
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm import batch_generate, load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def prompt_ids(prompt_len, vocab_size):
    # The same formula is in parity: any change here must be made there too, or the two
    # runs stop computing the same thing (and greedy_tokens stops matching).
    if vocab_size >= 21000:
        return [1000 + (i * 7919) % 20000 for i in range(prompt_len)]
    return [3 + (i * 7919) % (vocab_size - 3) for i in range(prompt_len)]


def ragged_lengths(prompt_len, batch):
    # parity's bench::ragged_lengths: row 0 has prompt_len, later rows down to about half.
    return [max(prompt_len - b * prompt_len // (2 * batch), 1) for b in range(batch)]


def cast_model(model, dtype):
    # As `mlx_lm convert --dtype` does: every floating parameter is cast, which for quantized
    # layers includes scales and biases (the packed uint32 weights are left alone), so the
    # whole forward pass runs in `dtype`. Casting only the float weights would leave bf16
    # scales, and the dequantized matmuls would round through bf16. Some architectures keep
    # a few parameters (MoE router biases, ...) in their own dtype via `cast_predicate`.
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, value):
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))
    mx.eval(model.parameters())


def greedy_run(model, ids, steps, timed):
    """Prefill `ids`, then `steps` single-token decode steps. Returns (tokens, times) where
    times = (prefill_s, ttft_s, decode_s) if `timed`, else None."""
    # Built before the clock starts: the cache is empty until the first forward pass, and
    # the previous run's cache is freed here rather than inside a timed region.
    cache = make_prompt_cache(model)
    prompt = mx.array([ids], dtype=mx.uint32)
    mx.eval(prompt)

    t0 = time.perf_counter()
    logits = model(prompt, cache=cache)[:, -1, :]
    mx.eval(logits)
    t1 = time.perf_counter()
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    t2 = time.perf_counter()

    # Each step waits for its token on the host before building the next input, as parity's
    # engine loop does; generate_step (and parity's bench) queue step n+1 before reading token n.
    tokens = [token.item()]
    for _ in range(steps):
        logits = model(mx.array([[tokens[-1]]], dtype=mx.uint32), cache=cache)[:, -1, :]
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
        tokens.append(token.item())
    t3 = time.perf_counter()

    return tokens, ((t1 - t0, t2 - t0, t3 - t2) if timed else None)


def step_run(model, ids, steps):
    """mlx-lm's generate_step: (tokens, prefill_s, decode_s) for `steps` tokens after the first."""
    t0 = time.perf_counter()
    tokens = []
    t1 = t0
    for i, (token, _) in enumerate(generate_step(mx.array(ids, dtype=mx.uint32), model, max_tokens=steps + 1)):
        if i == 0:
            t1 = time.perf_counter()
        tokens.append(int(token))
    return tokens, t1 - t0, time.perf_counter() - t1


class NoStop:
    """What batch_generate asks of a tokenizer, with no stop tokens (see the module docs)."""

    eos_token_ids = []

    def decode(self, _ids):
        return ""


def batch_run(model, prompts, steps):
    """mlx-lm's batch_generate: (per-row tokens, its BatchStats)."""
    r = batch_generate(model, NoStop(), prompts, max_tokens=steps + 1, return_token_ids=True)
    if any(len(t) != steps + 1 for t in r.token_ids):
        sys.exit("error: batch_generate stopped a row early; the rows must all do the same work")
    return r.token_ids, r.stats


def openblas_config(maps):
    """OpenBLAS's configuration and the kernel it chose, worded as `parity bench` words it
    (runtime::blas), so the two sides can be checked to run the same kernel: an OpenBLAS
    that does not know the CPU runs its generic Prescott kernel, 2-3x slower."""
    path = next((line.split()[-1] for line in maps.splitlines() if "libopenblas" in line), None)
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode().strip()
        core = lib.openblas_get_corename().decode().strip()
    except (OSError, AttributeError, TypeError):
        return "openblas"
    blas = config if core in config else f"{config} (core {core})"
    # ci/blas/gemv_forward.c in front of OpenBLAS, worded as parity words it, so a bench
    # baseline taken with it on is not compared with a run that has it off.
    shim = next((line.split()[-1] for line in maps.splitlines() if "libparity-gemv-forward" in line), None)
    if shim:
        try:
            label = ctypes.CDLL(shim).parity_blas_shim
            label.restype = ctypes.c_char_p
            blas += " + " + label().decode()
        except (OSError, AttributeError):
            return blas + " + GEMM forwarding (state unknown)"
    return blas


def blas_in_use():
    if sys.platform == "darwin":
        return "accelerate"
    # Which library the dynamic loader actually mapped, not what the venv was meant to
    # have: a pip reinstall of mlx-cpu silently brings netlib back.
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    if "libopenblas" in maps:
        return openblas_config(maps)
    if "mlx_cpu.libs/libblas-" in maps:
        return "netlib"
    return "unknown"


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def check_reference(model, path):
    with open(path) as f:
        ref = json.load(f)
    failures = 0
    for n, case in enumerate(ref["cases"]):
        want = case["greedy"]
        got, _ = greedy_run(model, case["prompt_ids"], len(want) - 1, timed=False)
        label = case.get("text", f"case {n}")
        if got == want:
            print(f"ok       {label!r}: {len(want)} tokens match")
        else:
            failures += 1
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            print(f"MISMATCH {label!r}: first difference at step {at}")
            print(f"  want {want}\n  got  {got}")
    print(f"{len(ref['cases']) - failures} passed, {failures} failed")
    return failures == 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--batch",
        default="1",
        help="batch sizes for batch_generate, comma separated (ragged lengths as parity's bench)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="dequantize every quantized layer after the cast (as parity's --dequantize)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--check-reference",
        metavar="PATH",
        help="instead of benchmarking, check greedy tokens against an mlx-lm reference file",
    )
    args = p.parse_args()
    for name in ("prompt_len", "decode", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        p.error(f"--batch {args.batch}: expected comma-separated integers")
    if not batches or min(batches) < 1:
        p.error("--batch sizes must be at least 1")

    # The same device choice as parity's (PARITY_DEVICE: auto, cpu or gpu), so that
    # `PARITY_DEVICE=cpu` benchmarks both sides on the CPU; `parity bench --mlx-lm` refuses a
    # baseline from another device. auto: the GPU on macOS, else the CPU (no GPU on Linux here).
    wanted = os.environ.get("PARITY_DEVICE", "auto")
    if wanted not in ("auto", "cpu", "gpu"):
        p.error(f"PARITY_DEVICE={wanted}: expected auto, cpu or gpu")
    if wanted == "cpu" or (wanted == "auto" and sys.platform != "darwin"):
        mx.set_default_device(mx.cpu)
    elif wanted == "gpu":
        # Metal on macOS, CUDA where the mlx-cuda wheel is installed (mx.cuda exists in 0.32).
        cuda = getattr(mx, "cuda", None)
        if not (mx.metal.is_available() or (cuda is not None and cuda.is_available())):
            p.error("PARITY_DEVICE=gpu but this MLX has no GPU backend (neither Metal nor CUDA)")
        mx.set_default_device(mx.gpu)
    device = "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"

    if args.check_reference:
        with open(args.check_reference) as f:
            ref_dtype = json.load(f).get("dtype")
        if ref_dtype and ref_dtype != args.dtype:
            p.error(f"the reference was made at {ref_dtype}; pass --dtype {ref_dtype}")
    elif device == "cpu" and args.dtype != "float32":
        # MLX 0.32's CPU quantized matmul has no fast half-precision path; measured here,
        # bf16 is ~8x and f16 ~40x slower than f32, so default sizes take many minutes.
        print(f"note: {args.dtype} on MLX's CPU backend is very slow", file=sys.stderr)

    model, _tokenizer, config = load(args.checkpoint, return_config=True)
    cast_model(model, DTYPES[args.dtype])
    if args.dequantize:
        # After the cast, so the weights come out of float32 scales and biases, as parity's do.
        model = dequantize_model(model)
        mx.eval(model.parameters())

    if args.check_reference:
        sys.exit(0 if check_reference(model, args.check_reference) else 1)

    vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab_size or vocab_size <= 3:
        sys.exit(f"error: no usable vocab_size in {args.checkpoint}/config.json")
    ids = prompt_ids(args.prompt_len, vocab_size)

    # The warm-up pays for first-touch page faults, BLAS thread start-up and MLX's
    # allocator growing its pool, none of which a steady-state number should include.
    greedy_tokens, _ = greedy_run(model, ids, args.decode, timed=False)
    prefill_tps, decode_tps, ttft_ms = [], [], []
    for _ in range(args.reps):
        gc.collect()
        tokens, (prefill_s, ttft_s, decode_s) = greedy_run(model, ids, args.decode, timed=True)
        if tokens != greedy_tokens:
            # Greedy decoding is deterministic on one machine; a difference means the timed
            # runs did not do the work the reported tokens describe.
            sys.exit("error: greedy tokens differ between repetitions")
        prefill_tps.append(args.prompt_len / prefill_s)
        decode_tps.append(args.decode / decode_s)
        ttft_ms.append(ttft_s * 1000)

    # generate_step, warmed up like the rest.
    step_tokens, _, _ = step_run(model, ids, args.decode)
    step_prefill, step_decode = [], []
    for _ in range(args.reps):
        gc.collect()
        tokens, prefill_s, decode_s = step_run(model, ids, args.decode)
        if tokens != step_tokens:
            sys.exit("error: generate_step tokens differ between repetitions")
        step_prefill.append(args.prompt_len / prefill_s)
        step_decode.append(args.decode / decode_s)

    batch_results = []
    for batch in batches:
        lengths = ragged_lengths(args.prompt_len, batch)
        prompts = [ids[:n] for n in lengths]
        rows, _ = batch_run(model, prompts, args.decode)
        prompt_tps, generation_tps = [], []
        for _ in range(args.reps):
            gc.collect()
            again, stats = batch_run(model, prompts, args.decode)
            if again != rows:
                sys.exit(f"error: batch_generate tokens differ between repetitions (batch {batch})")
            prompt_tps.append(stats.prompt_tps)
            generation_tps.append(stats.generation_tps)
        batch_results.append(
            {
                "batch": batch,
                "prompt_lengths": lengths,
                "prefill_tps": summary(prompt_tps),
                "decode_tps": summary(generation_tps),
                "greedy_tokens": rows,
            }
        )

    result = {
        "runtime": "mlx-lm",
        "mlx_lm_version": importlib.metadata.version("mlx-lm"),
        "mlx_version": mx.__version__,
        "checkpoint": os.path.abspath(args.checkpoint),
        "dtype": args.dtype,
        "dequantized": args.dequantize,
        "prompt_len": args.prompt_len,
        "decode": args.decode,
        "reps": args.reps,
        "prefill_tps": summary(prefill_tps),
        "decode_tps": summary(decode_tps),
        "ttft_ms": summary(ttft_ms),
        "device": device,
        "blas": blas_in_use(),
        "greedy_tokens": greedy_tokens,
        "generate_step": {
            "prefill_tps": summary(step_prefill),
            "decode_tps": summary(step_decode),
            "greedy_tokens": step_tokens,
        },
        "batch_generate": batch_results,
    }

    print(
        f"mlx-lm {result['mlx_lm_version']} (mlx {result['mlx_version']}, {device}, "
        f"{result['blas']}), {args.dtype}{' dequantized' if args.dequantize else ''}, "
        f"prompt {args.prompt_len}, decode {args.decode}, "
        f"{args.reps} reps after 1 warm-up"
    )
    print(f"{'':34}{'median':>10}{'min':>10}{'max':>10}")
    rows = [
        ("sync loop, B=1: prefill tok/s", result["prefill_tps"]),
        ("sync loop, B=1: decode tok/s", result["decode_tps"]),
        ("sync loop, B=1: TTFT ms", result["ttft_ms"]),
        ("generate_step: decode tok/s", result["generate_step"]["decode_tps"]),
    ]
    for b in batch_results:
        rows.append((f"batch_generate B={b['batch']}: prompt tok/s", b["prefill_tps"]))
        rows.append((f"batch_generate B={b['batch']}: decode tok/s", b["decode_tps"]))
    for label, s in rows:
        print(f"{label:34}{s['median']:10.1f}{s['min']:10.1f}{s['max']:10.1f}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
