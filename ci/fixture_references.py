"""mlx-lm's greedy decode on parity's tiny fixtures: an independent implementation of the
Llama 3 (rope_scaling llama3, GQA, untied head) and Qwen3 (q/k norms, 4-bit, tied quantized
embedding) forward passes to check parity's dense path against, beyond the SmolLM2 reference.

    python fixture_references.py OUT.json NAME=CHECKPOINT_DIR [NAME=CHECKPOINT_DIR ...]

Prompts are token ids (the fixtures' tokenizer is byte-level, so ids are bytes): lengths that
cross the small block and tile sizes the fixture suite uses. Output mirrors
shared/reference/*.json: per fixture, per prompt, the greedy ids and top-5 per step, float32.
"""

import json
import sys

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from bench_mlx_lm import cast_model

STEPS = 16
TEXT = b"One position counter per sequence; a trim either works or fails loudly."
LENGTHS = [5, 17, 37]


def greedy(model, ids, steps, cache=None):
    """Greedy ids and the top-5 (id, logit) of each step; `cache`: the model's own by default."""
    cache = make_prompt_cache(model) if cache is None else cache
    logits = model(mx.array([ids], dtype=mx.uint32), cache=cache)[:, -1, :]
    tokens, top5 = [], []
    for _ in range(steps):
        row = logits[0].astype(mx.float32)
        order = mx.argsort(-row)[:5]
        mx.eval(row, order)
        top5.append([[int(i), float(row[int(i)].item())] for i in order.tolist()])
        tokens.append(int(order[0].item()))
        logits = model(mx.array([[tokens[-1]]], dtype=mx.uint32), cache=cache)[:, -1, :]
    return tokens, top5


def main():
    out, pairs = sys.argv[1], sys.argv[2:]
    mx.set_default_device(mx.cpu)
    result = {"runtime": "mlx-lm", "mlx_lm_version": mlx_lm.__version__, "mlx_version": mx.__version__,
              "dtype": "float32", "steps": STEPS, "fixtures": {}}
    for pair in pairs:
        name, path = pair.split("=", 1)
        model, _ = load(path)
        cast_model(model, mx.float32)
        cases = []
        for n in LENGTHS:
            ids = list(TEXT[:n])
            tokens, top5 = greedy(model, ids, STEPS)
            cases.append({"prompt_ids": ids, "greedy": tokens, "top5": top5})
            print(f"{name} len {n}: {tokens}")
        result["fixtures"][name] = cases
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
