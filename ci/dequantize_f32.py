"""Write a float32 copy of an MLX checkpoint with its quantized weights dequantized.

    ci/mlx-lm ci/dequantize_f32.py SRC DST

mlx_lm.server serves a checkpoint as stored. On MLX 0.32's CPU backend the 4-bit SmolLM2
computes in bfloat16 through a single-threaded quantized matmul: measured 16 prompt tokens in
~150 s on the shared CI machine, unusable for a suite. The float32 copy holds exactly the
dequantized weights (scale * q + bias, computed by mlx-lm's own `dequantize`) and runs through
BLAS. Written to DST.tmp first, renamed when complete, so an interrupted run leaves no half copy.
"""
import shutil
import sys
from pathlib import Path

from mlx_lm import convert

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
tmp = dst.with_name(dst.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
convert(str(src), mlx_path=str(tmp), dequantize=True, dtype="float32")
# The chat template travels in tokenizer files; a standalone chat_template.jinja may not.
for extra in ("chat_template.jinja",):
    if (src / extra).is_file() and not (tmp / extra).is_file():
        shutil.copy(src / extra, tmp / extra)
shutil.rmtree(dst, ignore_errors=True)
tmp.rename(dst)
print(dst)
