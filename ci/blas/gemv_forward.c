/*
 * cblas_sgemm for MLX's CPU backend, with one-row products sent to cblas_sgemv and products of
 * a few rows by a large weight matrix to a kernel that reads the weights once.
 *
 * Why: a decode step at batch 1 multiplies one activation row by every weight matrix. OpenBLAS
 * 0.3.21 (Debian 12) runs that as a general GEMM, which first copies the whole weight matrix
 * into its packed layout: every step then reads the weights, writes the copy and reads it
 * again, and reaches about a third of the memory bandwidth a GEMV reaches on the same matrix.
 * OpenBLAS 0.3.27 and later forward such calls to GEMV themselves (GEMM_GEMV_FORWARD), but
 * Debian 12 has no such build and Debian 13's needs a newer glibc. This file does the same
 * forwarding. A decode step at batch 2 to 12 (and a prefill chunk of so many tokens) has the
 * same trouble with M rows: OpenBLAS still packs the whole matrix, and no BLAS call reads a
 * matrix once for several rows, so few_rows() below does (on SmolLM2's [in, out] matrices,
 * cycled cold: 2.4x OpenBLAS's rate at M = 2, 1.5x at 8, 1.4x at 12, about even at 16). Every other call, and every other BLAS
 * symbol, is OpenBLAS's.
 *
 * Built by ci/blas.sh, which points the mlx-cpu wheel's libblas at it (parity's MLX and
 * mlx-lm's alike, so a benchmark's two sides run the same BLAS). PARITY_GEMV_FORWARD=0 in the
 * environment turns the forwarding off at run time: the same process, the GEMM path, for
 * measuring one against the other; it turns off both.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112, ConjTrans = 113 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
void cblas_sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda, const float *x, int incx,
                 float beta, float *y, int incy);

static sgemm_fn real_sgemm(void) {
    static sgemm_fn f;
    if (!f) f = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    return f;
}

/* 1 when forwarding is on (the default), read once. */
int parity_gemv_forward(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("PARITY_GEMV_FORWARD");
        on = !(v && strcmp(v, "0") == 0);
    }
    return on;
}

/* What a report's environment says of this file (src/environment.rs and ci/bench_mlx_lm.py
 * read it): a baseline measured with other forwarding is refused against this one. */
const char *parity_blas_shim(void) {
    return parity_gemv_forward() ? "one-row GEMM as GEMV, 2-12-row GEMM reading the weights once"
                                 : "GEMM forwarding off";
}

/* y = alpha * op(A) x + beta * y, with op(A) rows x cols. beta == 0 must not read y (GEMM
 * does not read C then, and MLX hands over uninitialised output): it is zeroed first. */
static void gemv(int trans_a, int rows, int cols, float alpha, const float *a, int lda, const float *x, int incx,
                 float beta, float *y, int incy) {
    if (beta == 0.0f)
        for (int i = 0; i < rows; i++) y[(long)i * incy] = 0.0f;
    if (trans_a == NoTrans)
        cblas_sgemv(RowMajor, NoTrans, rows, cols, alpha, a, lda, x, incx, beta, y, incy);
    else
        cblas_sgemv(RowMajor, Trans, cols, rows, alpha, a, lda, x, incx, beta, y, incy);
}

/* Below this many elements (256 KiB of float32) the matrix sits in cache, packing it is cheap
 * and OpenBLAS's small-matrix GEMM kernel beats its GEMV (0.4-0.9x the time, warm, measured at
 * 160x64 to 64x2048): the attention's per-head one-row products at short contexts are of that
 * size, and forwarding them made batch-32 decode slower. Weight matrices are all above it. */
enum { MinForwardElements = 65536 };

/* Products of 2 to MaxFewRows rows by a weight matrix of at least MinForwardElements: each
 * thread takes a run of the output's columns and reads its part of the weights once for every
 * row. A row's sums do not depend on how many rows share the call: every output element is
 * summed over K in one order whatever the number of rows, so a sequence decoded next to one
 * other gets the logits it gets next to eleven. */
enum { MaxFewRows = 12, KBlock = 16 };
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* acc (m x [j0, j1), ldacc, column j0 at acc[0]) = A B over B's rows stored [k][n]: B is
 * streamed KBlock rows at a time (as many sequential reads) and each element of acc gets its
 * products in k's order, added one by one. */
static inline __attribute__((always_inline)) void nn_columns(int m, int k, const float *a, int lda, const float *b,
                                                             int ldb, float *acc, int ldacc, int j0, int j1) {
    for (int k0 = 0; k0 < k; k0 += KBlock) {
        int kb = k - k0 < KBlock ? k - k0 : KBlock;
        int j = j0;
        for (; j + 16 <= j1; j += 16) {
            v16 bv[KBlock] = {{0}};
            for (int r = 0; r < KBlock; r++)
                if (r < kb) memcpy(&bv[r], b + (long)(k0 + r) * ldb + j, sizeof(v16));
            for (int i = 0; i < m; i++) {
                float *out = acc + (long)i * ldacc + (j - j0);
                const float *ai = a + (long)i * lda + k0;
                v16 c = {0};
                if (k0 > 0) memcpy(&c, out, sizeof c);
                for (int r = 0; r < KBlock; r++)
                    if (r < kb) c += ai[r] * bv[r];
                memcpy(out, &c, sizeof c);
            }
        }
        for (; j < j1; j++)
            for (int i = 0; i < m; i++) {
                float *out = acc + (long)i * ldacc + (j - j0);
                float c = k0 > 0 ? *out : 0.0f;
                for (int r = 0; r < kb; r++) c += a[(long)i * lda + k0 + r] * b[(long)(k0 + r) * ldb + j];
                *out = c;
            }
    }
}

/* The same over B's rows stored [n][k] (op(B) = B^T, as `x @ W.T` with W [out, in] arrives):
 * each output element is a dot product of two contiguous rows, summed in 16 lanes, then the
 * lanes in order, then the tail. */
static inline __attribute__((always_inline)) void nt_columns(int m, int k, const float *a, int lda, const float *b,
                                                             int ldb, float *acc, int ldacc, int j0, int j1) {
    for (int j = j0; j < j1; j++) {
        const float *wr = b + (long)j * ldb;
        for (int i = 0; i < m; i++) {
            const float *ai = a + (long)i * lda;
            v16 v = {0};
            int q = 0;
            for (; q + 16 <= k; q += 16) {
                v16 x, y;
                memcpy(&x, wr + q, sizeof x);
                memcpy(&y, ai + q, sizeof y);
                v += x * y;
            }
            float c = 0.0f;
            for (int l = 0; l < 16; l++) c += v[l];
            for (; q < k; q++) c += wr[q] * ai[q];
            acc[(long)i * ldacc + (j - j0)] = c;
        }
    }
}

/* C (m x n, ldc) = alpha A op(B) + beta C, A's rows contiguous; `scratch` (m x n) holds the
 * sums when beta != 0 (beta == 0 must not read C, see gemv above: then C itself holds them).
 * Compiled for AVX-512, AVX2 + FMA and the baseline, chosen at load by the CPU; a product is
 * the same on every run of one machine. */
__attribute__((target_clones("avx512f", "arch=haswell", "default"))) static void few_rows(
    int trans_b, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta,
    float *c, int ldc, float *scratch) {
#pragma omp parallel
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int per = ((n + nt - 1) / nt + 15) & ~15;
        int j0 = t * per < n ? t * per : n, j1 = j0 + per < n ? j0 + per : n;
        int width = j1 - j0, ldacc = scratch ? n : ldc;
        float *acc = (scratch ? scratch : c) + j0;
        if (width > 0) {
            if (trans_b)
                nt_columns(m, k, a, lda, b, ldb, acc, ldacc, j0, j1);
            else
                nn_columns(m, k, a, lda, b, ldb, acc, ldacc, j0, j1);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < width; j++) {
                    float *o = c + (long)i * ldc + j0 + j;
                    float p = acc[(long)i * ldacc + j];
                    *o = beta == 0.0f ? alpha * p : alpha * p + beta * *o;
                }
        }
    }
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    sgemm_fn gemm = real_sgemm();
    if (!parity_gemv_forward() || m <= 0 || n <= 0 || k <= 0 || (order != RowMajor && order != ColMajor)) {
        gemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* Column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T. */
    if (order == ColMajor) {
        int t = ta;
        const float *p = a;
        int l = lda, s = m;
        ta = tb, a = b, lda = ldb, m = n;
        tb = t, b = p, ldb = l, n = s;
    }
    int ta_no = ta == NoTrans, tb_no = tb == NoTrans;
    /* The weight operand: op(B) for one or a few rows of A, op(A) for one column of B. */
    long big = m == 1 || (m <= MaxFewRows && n > 1) ? (long)n * k : (long)m * k;
    if (big < MinForwardElements || (m != 1 && n != 1 && (m > MaxFewRows || !ta_no))) {
        gemm(RowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (m > 1 && n > 1) {
        float *scratch = beta != 0.0f ? malloc(sizeof(float) * (size_t)m * (size_t)n) : NULL;
        if (beta != 0.0f && !scratch) {
            gemm(RowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
        few_rows(!tb_no, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, scratch);
        free(scratch);
    } else if (m == 1) {
        /* C (1 x n, contiguous) = x op(B): x is A's one row, op(B)^T is n x k. */
        int incx = ta_no ? 1 : lda;
        gemv(tb_no ? Trans : NoTrans, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    } else {
        /* C (m x 1, stride ldc) = op(A) x: x is op(B)'s one column. */
        int incx = tb_no ? ldb : 1;
        gemv(ta_no ? NoTrans : Trans, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    }
}
