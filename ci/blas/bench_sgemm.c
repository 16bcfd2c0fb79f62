/*
 * cblas_sgemm of 1 to N rows by SmolLM2-135M's 120 layer matrices (30 layers of q/k/v, o,
 * gate/up and down; 425 MB, cycled so every matrix comes from memory), best of six passes, as
 * GB/s of weights read: the shim's kernels against OpenBLAS's GEMM in one binary, switched by
 * PARITY_GEMV_FORWARD (0: every call goes to OpenBLAS).
 *
 *   gcc -O2 -o /tmp/bench_sgemm ci/blas/bench_sgemm.c .deps/blas/libparity-gemv-forward.so \
 *       -Wl,-rpath,"$PWD/.deps/blas"
 *   for f in 0 1; do PARITY_GEMV_FORWARD=$f /tmp/bench_sgemm nn 1 2 4 8 12 16; done
 *
 * `nn`: weights stored [in, out] (parity's); `nt`: [out, in], multiplied as x @ W.T (mlx-lm's).
 * Not part of any test: a measurement aid for ci/blas/gemv_forward.c's limits.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "nn") != 0 && strcmp(argv[1], "nt") != 0)) {
        fprintf(stderr, "usage: %s nn|nt ROWS...\n", argv[0]);
        return 2;
    }
    int nt = strcmp(argv[1], "nt") == 0;
    int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}; /* out, in */
    enum { L = 30 };
    float *w[L * 4]; long bytes = 0;
    for (int i = 0; i < L * 4; i++) {
        long e = (long)shapes[i % 4][0] * shapes[i % 4][1];
        w[i] = malloc(sizeof(float) * e);
        for (long q = 0; q < e; q++) w[i][q] = (float)((q * 7919 + i) % 1000 - 500) * 1e-3f;
        bytes += e * 4;
    }
    float *a = malloc(sizeof(float) * 32 * 1536), *c = malloc(sizeof(float) * 32 * 3072);
    for (int q = 0; q < 32 * 1536; q++) a[q] = (float)(q % 777 - 388) * 1e-3f;
    for (int ai = 2; ai < argc; ai++) {
        int m = atoi(argv[ai]);
        if (m < 1 || m > 32) {
            fprintf(stderr, "rows must be 1 to 32: %s\n", argv[ai]);
            return 2;
        }
        double best = 1e9;
        for (int r = 0; r < 6; r++) {
            double t0 = now();
            for (int i = 0; i < L * 4; i++) {
                int n = shapes[i % 4][0], k = shapes[i % 4][1];
                cblas_sgemm(101, 111, nt ? 112 : 111, m, n, k, 1.0f, a, k, w[i], nt ? k : n, 0.0f, c, n);
            }
            double t = now() - t0;
            if (t < best) best = t;
        }
        printf("%s rows %2d: %6.2f ms, %5.1f GB/s\n", argv[1], m, best * 1e3, bytes / best / 1e9);
    }
    return 0;
}
