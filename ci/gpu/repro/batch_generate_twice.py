#!/usr/bin/env python3
"""mlx-lm's batch_generate run several times on the same batch, as its benchmark does: are the
greedy tokens the same every time, and if not, which forward first differs?

ci/bench_mlx_lm.py runs each batch size `--reps` times and stops when two repetitions' tokens
differ; on the H200 in bfloat16 it stopped at batch 8. parity's stepped `repeat` scenario (the
concurrent schedule run twice) did not reproduce it, so this runs batch_generate itself, with
the benchmark's prompts (ci/bench_mlx_lm.py: prompt_ids, ragged_lengths), then narrows it down:

  generate   batch_generate RUNS times on the same prompts: per run, the rows whose tokens differ
             from run 1's and the first differing position
  forward    one forward pass of the same left-padded batch (no cache, no mask), RUNS times: how many runs
             give logits bit-identical to the first, and the largest difference
  single     the same for one row alone (B = 1)

each in the dtypes of --dtypes (default bfloat16 and float32; float32 with MLX_ENABLE_TF32 as
the environment has it). On the H200 (docs/gpu.md) batch 8 alone repeated itself, and the
order 1, 8, 32, 64 did not: rows differed from the first run from the first token on.
With --batches 1,8,32,64 the generate part runs those batches in that order, each RUNS times
against its own first run, as the benchmark does (the forward parts keep --batch).
Usage: batch_generate_twice.py CHECKPOINT [--batch 8] [--batches B,...] [--runs 5]
       [--dtypes bfloat16,float32] [--json out.json];
exit 77 with "SKIP(no-gpu)" where MLX has no CUDA device.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", help="comma-separated batch sizes run in this order, each RUNS "
                   "times against its own first run, as ci/bench_mlx_lm.py does (default: --batch)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--json")
    args = p.parse_args()

    import mlx.core as mx

    if not mx.cuda.is_available():
        print("SKIP(no-gpu): MLX has no CUDA device here")
        sys.exit(77)
    from mlx_lm import load

    import bench_mlx_lm as bench

    out = {"batch": args.batch, "runs": args.runs, "mlx": mx.__version__,
           "tf32": os.environ.get("MLX_ENABLE_TF32"), "dtypes": {}}
    for name in args.dtypes.split(","):
        model, _ = load(args.checkpoint)
        bench.cast_model(model, bench.DTYPES[name])
        ids = bench.prompt_ids(args.prompt_len, model.args.vocab_size)
        lengths = bench.ragged_lengths(args.prompt_len, args.batch)
        prompts = [ids[:n] for n in lengths]
        res = {}

        def generate(batch):
            sizes = bench.ragged_lengths(args.prompt_len, batch)
            first, runs = None, []
            for r in range(args.runs):
                tokens, _ = bench.batch_run(model, [ids[:n] for n in sizes], args.decode)
                if first is None:
                    first = tokens
                rows = []
                for b, (a, t) in enumerate(zip(first, tokens)):
                    diff = next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), None)
                    if diff is not None:
                        rows.append({"row": b, "length": sizes[b], "first_position": diff})
                runs.append({"run": r + 1, "rows_differing_from_run_1": rows})
            return runs

        order = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
        runs = {str(b): generate(b) for b in order}
        res["generate"] = runs

        # One forward of the left-padded batch, no cache and no mask (so not batch_generate's
        # prefill), the same inputs every time: are the model's kernels alone repeatable?
        width = max(lengths)
        padded = mx.array([[0] * (width - n) + p for n, p in zip(lengths, prompts)], dtype=mx.uint32)

        def repeat(x):
            base = None
            same, worst = 0, 0.0
            for _ in range(args.runs):
                y = model(x).astype(mx.float32)
                mx.eval(y)
                if base is None:
                    base = y
                    continue
                d = mx.abs(y - base).max().item()
                same += d == 0.0
                worst = max(worst, d)
            return {"identical_to_first": same, "of": args.runs - 1, "max_abs_difference": worst}

        res["forward"] = repeat(padded)
        res["single"] = repeat(mx.array([prompts[0]], dtype=mx.uint32))
        out["dtypes"][name] = res
        differing = {b: [len(r["rows_differing_from_run_1"]) for r in rs] for b, rs in runs.items()}
        print(name, "rows differing from run 1, per run, by batch:", json.dumps(differing),
              "forward:", json.dumps(res["forward"]), "single:", json.dumps(res["single"]))
        del model
        mx.clear_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
