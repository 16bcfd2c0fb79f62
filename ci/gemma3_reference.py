"""mlx-lm's float32 greedy decode on the converted Gemma 3 270M (ci/gemma3-270m): the reference
tests/reference.rs checks parity's gemma3 dense and paged paths against, as
shared/reference/smollm2-*.json is for SmolLM2.

    ci/mlx-lm ci/gemma3_reference.py CHECKPOINT OUT.json

Plain text prompts (the 270M is a base model: no chat template), one of them longer than the
512-position window, so the sliding layers' windows move during prefill and decode. Each is
decoded twice: with mlx-lm's own caches for the model (make_prompt_cache: RotatingKVCache of 512
on the sliding layers, KVCache on the global ones) and with a KVCache on every layer (the window
applied by the mask alone). The file records the first; the two must agree, or this script
stops and says where.
"""

import json
import sys

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.models.cache import KVCache

from bench_mlx_lm import cast_model
from fixture_references import greedy

STEPS = 16
SHORT = ["The capital of France is", "def fibonacci(n):", "Paged KV caches keep each sequence's keys and values in"]
# A long prompt past the window: a paragraph of plain prose about caches, repeated with numbers
# so that no two repetitions tokenize alike.
PARAGRAPH = (
    "A cache that pages its keys and values keeps a table of blocks for every sequence. "
    "When a sequence grows, a new block is taken from the pool; when it is trimmed, blocks at "
    "its end go back. A sliding window only ever looks at the most recent rows, so blocks that "
    "fall out of every window can be released, unless a rollback could bring them back. "
)
LONG = " ".join(f"Part {i}. {PARAGRAPH}" for i in range(1, 11))


def main():
    path, out = sys.argv[1], sys.argv[2]
    mx.set_default_device(mx.cpu)
    model, tok = load(path)
    cast_model(model, mx.float32)
    cases = []
    for text in SHORT + [LONG]:
        ids = tok.encode(text)
        tokens, top5 = greedy(model, ids, STEPS)
        full, _ = greedy(model, ids, STEPS, [KVCache() for _ in model.layers])
        if full != tokens:
            sys.exit(f"{len(ids)}-token prompt: mlx-lm's caches give {tokens}, KVCache everywhere {full}")
        cases.append({"kind": "text", "text": text, "prompt_ids": ids, "greedy": tokens, "top5": top5,
                      "decoded": tok.decode(tokens)})
        print(f"{len(ids)} tokens: {tok.decode(tokens)!r}")
    result = {"runtime": "mlx-lm", "mlx_lm_version": mlx_lm.__version__, "mlx_version": mx.__version__,
              "dtype": "float32", "steps": STEPS, "window": 512, "cases": cases}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
