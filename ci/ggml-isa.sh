# shellcheck shell=bash
# Sourced by ci/llama-server and ci/llama-cpp: the cmake flags that build ggml's CPU backend for
# this machine's vector extensions, named one by one rather than -march=native. A native build
# enables ggml's AMX kernels wherever the CPU advertises AMX, and on a VM that advertises it
# without granting it (Xeon family 6 model 207 here) llama.cpp dies with SIGSEGV loading a model.

# Prints one flag per line.
ggml_isa_flags() {
  local flags f
  printf '%s\n' -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case " $flags " in *" ${f%%:*} "*) printf '%s\n' "-DGGML_${f##*:}=ON" ;; esac
  done
}
