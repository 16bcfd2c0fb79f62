# shellcheck shell=bash
# Sourced by ci/setup (parity's MLX) and ci/mlx-lm (mlx-lm's venv), so that both sides of a
# benchmark run on the same BLAS: the mlx-cpu wheel ships netlib BLAS/LAPACK, reached through
# its RPATH; pointing those files at Debian's OpenBLAS makes f32 GEMM ~27x faster.
# PARITY_NETLIB_BLAS=1 restores (or keeps) the wheel's own files. Idempotent.

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
# Prints "openblas" or "netlib": what the directory now holds.
point_wheel_blas() {
  local dir=$1 blas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread kind lib
  for kind in blas lapack; do
    lib=$(wheel_lib "$dir" "$kind")
    if [ -z "$lib" ]; then
      printf 'no lib%s in %s\n' "$kind" "$dir" >&2
      return 1
    fi
    if [ "${PARITY_NETLIB_BLAS:-0}" != 1 ] && [ -f "$blas_dir/lib$kind.so.3" ]; then
      [ -L "$lib" ] || { mv "$lib" "$lib.netlib" && ln -s "$blas_dir/lib$kind.so.3" "$lib"; }
    elif [ -L "$lib" ]; then
      rm "$lib" && mv "$lib.netlib" "$lib"
    fi
  done
  if [ -L "$(wheel_lib "$dir" blas)" ]; then echo openblas; else echo netlib; fi
}
