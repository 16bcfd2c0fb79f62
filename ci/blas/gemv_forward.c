/*
 * cblas_sgemm for MLX's CPU backend, with one-row products sent to cblas_sgemv.
 *
 * Why: a decode step at batch 1 multiplies one activation row by every weight matrix. OpenBLAS
 * 0.3.21 (Debian 12) runs that as a general GEMM, which first copies the whole weight matrix
 * into its packed layout: every step then reads the weights, writes the copy and reads it
 * again, and reaches about a third of the memory bandwidth a GEMV reaches on the same matrix.
 * OpenBLAS 0.3.27 and later forward such calls to GEMV themselves (GEMM_GEMV_FORWARD), but
 * Debian 12 has no such build and Debian 13's needs a newer glibc. This file does the same
 * forwarding and nothing else: every other call, and every other BLAS symbol, is OpenBLAS's.
 *
 * Built by ci/blas.sh, which points the mlx-cpu wheel's libblas at it (parity's MLX and
 * mlx-lm's alike, so a benchmark's two sides run the same BLAS). PARITY_GEMV_FORWARD=0 in the
 * environment turns the forwarding off at run time: the same process, the GEMM path, for
 * measuring one against the other.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
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

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    sgemm_fn gemm = real_sgemm();
    if (!parity_gemv_forward() || m <= 0 || n <= 0 || k <= 0 || (m != 1 && n != 1) || (order != RowMajor && order != ColMajor) ||
        (long)(m == 1 ? n : m) * k < MinForwardElements) {
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
    if (m == 1) {
        /* C (1 x n, contiguous) = x op(B): x is A's one row, op(B)^T is n x k. */
        int incx = ta_no ? 1 : lda;
        gemv(tb_no ? Trans : NoTrans, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    } else {
        /* C (m x 1, stride ldc) = op(A) x: x is op(B)'s one column. */
        int incx = tb_no ? ldb : 1;
        gemv(ta_no ? NoTrans : Trans, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    }
}
