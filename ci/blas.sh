# shellcheck shell=bash
# Sourced by ci/setup (parity's MLX) and ci/mlx-lm (mlx-lm's venv), so that both sides of a
# benchmark run on the same BLAS: the mlx-cpu wheel ships netlib BLAS/LAPACK, reached through
# its RPATH; pointing those files at Debian's OpenBLAS makes f32 GEMM ~27x faster, and its
# BLAS at ci/blas/gemv_forward.c (OpenBLAS with one-row GEMMs sent to GEMV, as OpenBLAS 0.3.27
# and later do themselves, and products of 1 to 12 rows to kernels of its own) makes a decode
# step at batch 1 to 12 read its weights once instead of three times. PARITY_NETLIB_BLAS=1
# restores (or keeps) the wheel's own files. Idempotent.

blas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread

# Build the GEMV-forwarding shim into .deps/blas/ (once per source); prints its path, or
# nothing when it cannot be built (then the wheel points at OpenBLAS itself).
gemv_forward_lib() {
  local src out stamp
  src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/blas/gemv_forward.c"
  out="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.deps/blas/libparity-gemv-forward.so"
  # The stamp covers this file too: a change of flags rebuilds.
  stamp=$(cat "$src" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$out.stamp" 2>/dev/null)" != "$stamp" ] || [ ! -f "$out" ]; then
    mkdir -p "$(dirname "$out")"
    # -O3 unrolls the few-row kernels' loops over a block so their sums stay in registers;
    # -ffp-contract=off keeps every clone's roundings the baseline's (see part() in the source).
    gcc -O3 -ffp-contract=off -pthread -shared -fPIC -Wall -Werror -o "$out.tmp" "$src" "$blas_dir/libopenblas.so.0" \
      -Wl,-rpath,"$blas_dir" -ldl >&2 || { rm -f "$out.tmp"; return 0; }
    mv "$out.tmp" "$out" && echo "$stamp" > "$out.stamp"
  fi
  printf '%s\n' "$out"
}

# The wheel's lib$2 in directory $1: not a .netlib backup left by an earlier swap.
wheel_lib() {
  local f
  for f in "$1"/lib"$2"-*.so.*; do
    case $f in
      *.netlib) ;;
      *) if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\n' "$f"; return; fi ;;
    esac
  done
}

# Point the BLAS and LAPACK in wheel library directory $1 at OpenBLAS, or back at netlib.
# Prints "openblas (1-12-row kernels, other one-row GEMM as GEMV)", "openblas" or "netlib": what the directory now holds.
point_wheel_blas() {
  local dir=$1 kind lib target shim=""
  if [ "${PARITY_NETLIB_BLAS:-0}" != 1 ] && [ -f "$blas_dir/libopenblas.so.0" ]; then
    shim=$(gemv_forward_lib)
  fi
  for kind in blas lapack; do
    lib=$(wheel_lib "$dir" "$kind")
    if [ -z "$lib" ]; then
      printf 'no lib%s in %s\n' "$kind" "$dir" >&2
      return 1
    fi
    target="$blas_dir/lib$kind.so.3"
    [ "$kind" = blas ] && [ -n "$shim" ] && target=$shim
    if [ "${PARITY_NETLIB_BLAS:-0}" != 1 ] && [ -f "$target" ]; then
      [ -L "$lib" ] || mv "$lib" "$lib.netlib"
      ln -sfn "$target" "$lib"
    elif [ -L "$lib" ]; then
      rm "$lib" && mv "$lib.netlib" "$lib"
    fi
  done
  lib=$(wheel_lib "$dir" blas)
  if [ -n "$shim" ] && [ "$(readlink "$lib")" = "$shim" ]; then
    echo "openblas (1-12-row kernels, other one-row GEMM as GEMV)"
  elif [ -L "$lib" ]; then
    echo openblas
  else
    echo netlib
  fi
}
