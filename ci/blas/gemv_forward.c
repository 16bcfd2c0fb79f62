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
 * matrix once for several rows, so few_rows() below does (on SmolLM2's [in, out] matrices
 * cycled cold, ci/blas/bench_sgemm.c: 2.5x OpenBLAS's rate at M = 2, 1.5x at 8, 1.4x at 12,
 * even at 16). By weights stored [in, out] (parity's) it takes one row too, split along K, and
 * while the caller runs the operations between two products a worker prefetches the next
 * matrix (see record_next). A matrix dequantized from a few bits can have its packed form
 * registered as its twin, and products of up to TwinMaxRows rows by it then read the twin (see
 * Packed twins). Products of 13 to 64 rows (a prefill of a short prompt) by [in, out] weights
 * run in FMA panels that copy nothing (see MaxPanelRows). Attention's two products also have
 * entry points of their own that read a paged cache's rows where they lie (parity_rows_scores,
 * parity_rows_values), with the chains the products over a gathered copy run here.
 * Every other call, and every other BLAS symbol, is OpenBLAS's.
 *
 * Built by ci/blas.sh, which points the mlx-cpu wheel's libblas at it (parity's MLX and
 * mlx-lm's alike, so a benchmark's two sides run the same BLAS). PARITY_GEMV_FORWARD=0 in the
 * environment turns the forwarding off at run time: the same process, the GEMM path, for
 * measuring one against the other; it turns off both.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112, ConjTrans = 113 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
int openblas_get_num_threads(void);
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

/* Products of up to MaxFewRows rows by a weight matrix of at least MinForwardElements read the
 * weights once for every row. A row's sums do not depend on how many rows share the call: every
 * output element is summed over K in one order whatever the number of rows, so a sequence
 * decoded next to one other gets the logits it gets next to eleven (and, with the weights
 * stored [in, out], the logits it gets alone). */
/* FloatAhead: how far ahead along each weight row (in floats, 4 KiB) nn_run asks for the rows it
 * streams, as the twins' kernel does (see TwinAhead): B=8 decode +8%. */
enum { MaxFewRows = 12, KRows = 4, FloatAhead = 1024 };
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef unsigned u8v __attribute__((vector_size(32), aligned(4)));
typedef int i8v __attribute__((vector_size(32), aligned(4)));
typedef unsigned u16v __attribute__((vector_size(64), aligned(4)));
typedef int i16v __attribute__((vector_size(64), aligned(4)));

/* Rows [i0, i0 + R) by the 16 columns at j over all k: each row's two vectors of sums stay in
 * registers for the whole run, so an element's sum is the same sequence of products, added one
 * by one from zero in k's order, as nn_run's four rows at a time: its bits, only not stored and
 * reloaded every four rows. The first block of rows asks for the row's next 256 bytes (four
 * panels on) as it goes. */
#define NN_BLOCK(R)                                                                                                   \
    do {                                                                                                              \
        v8 c[R][2];                                                                                                   \
        for (int i = 0; i < (R); i++) c[i][0] = c[i][1] = (v8){0};                                                    \
        for (int q = 0; q < k; q++) {                                                                                 \
            const float *bq = b + (long)q * ldb + j;                                                                  \
            if (i0 == 0) __builtin_prefetch(bq + 64, 0, 3);                                                           \
            v8 b0, b1;                                                                                                \
            memcpy(&b0, bq, sizeof b0);                                                                               \
            memcpy(&b1, bq + 8, sizeof b1);                                                                           \
            for (int i = 0; i < (R); i++) {                                                                           \
                float s = a[(long)(i0 + i) * lda + q];                                                                \
                c[i][0] += s * b0;                                                                                    \
                c[i][1] += s * b1;                                                                                    \
            }                                                                                                         \
        }                                                                                                             \
        for (int i = 0; i < (R); i++) {                                                                               \
            memcpy(acc + (long)(i0 + i) * n + j, &c[i][0], sizeof c[i][0]);                                           \
            memcpy(acc + (long)(i0 + i) * n + j + 8, &c[i][1], sizeof c[i][1]);                                       \
        }                                                                                                             \
    } while (0)

/* More than StreamRows rows (a decode step at batch 5 to 12, or such a prefill chunk): 16
 * columns at a time, in blocks of up to five rows whose sums stay in registers (NN_BLOCK), each
 * run of 16 columns read once from memory and again from L1 by the next block; the columns past
 * the last 16 as nn_run sums them. nn_run's way, every row's sums stored and reloaded every four
 * of K's rows, was bound by those stores and reloads there: bench_sgemm nn at 8 rows 63-64 ms,
 * this way 30-33 (2-core AMD EPYC, AVX2). */
enum { StreamRows = 4 };
static inline __attribute__((always_inline)) void nn_rows(int m, int k, const float *a, int lda, const float *b,
                                                           int ldb, float *acc, int n) {
    int blocks = (m + 4) / 5, j = 0;
    for (; j + 16 <= n; j += 16)
        for (int bl = 0, i0 = 0; bl < blocks; bl++) {
            int r = m / blocks + (bl < m % blocks);
            switch (r) {
            case 1: NN_BLOCK(1); break;
            case 2: NN_BLOCK(2); break;
            case 3: NN_BLOCK(3); break;
            case 4: NN_BLOCK(4); break;
            default: NN_BLOCK(5); break;
            }
            i0 += r;
        }
    for (; j < n; j++)
        for (int i = 0; i < m; i++) {
            float c = 0.0f;
            for (int q = 0; q < k; q++) c += a[(long)i * lda + q] * b[(long)q * ldb + j];
            acc[(long)i * n + j] = c;
        }
}

/* acc (m x n) = A B over a run of B's rows stored [k][n], KRows rows at a time: the thread
 * streams KRows whole rows at once, and each element of acc gets its products in k's order,
 * added one by one, so its sum does not depend on how many rows A has. (Sixteen rows at a
 * time, over a thread's share of the columns, read the o and down matrices at 13-17 GB/s
 * inside a decode step; four whole rows read them at 21-27.) */
static inline __attribute__((always_inline)) void nn_run(int m, int k, const float *a, int lda, const float *b,
                                                          int ldb, float *acc, int n) {
    if (m > StreamRows) {
        nn_rows(m, k, a, lda, b, ldb, acc, n);
        return;
    }
    for (int k0 = 0; k0 < k; k0 += KRows) {
        int kb = k - k0 < KRows ? k - k0 : KRows;
        int j = 0;
        for (; j + 16 <= n; j += 16) {
            v16 bv[KRows] = {{0}};
            for (int r = 0; r < KRows; r++)
                if (r < kb) {
                    __builtin_prefetch(b + (long)(k0 + r) * ldb + j + FloatAhead, 0, 3);
                    memcpy(&bv[r], b + (long)(k0 + r) * ldb + j, sizeof(v16));
                }
            for (int i = 0; i < m; i++) {
                float *out = acc + (long)i * n + j;
                const float *ai = a + (long)i * lda + k0;
                v16 c = {0};
                if (k0 > 0) memcpy(&c, out, sizeof c);
                for (int r = 0; r < KRows; r++)
                    if (r < kb) c += ai[r] * bv[r];
                memcpy(out, &c, sizeof c);
            }
        }
        for (; j < n; j++)
            for (int i = 0; i < m; i++) {
                float *out = acc + (long)i * n + j;
                float c = k0 > 0 ? *out : 0.0f;
                for (int r = 0; r < kb; r++) c += a[(long)i * lda + k0 + r] * b[(long)(k0 + r) * ldb + j];
                *out = c;
            }
    }
}

/* The same over B's rows stored [n][k] (op(B) = B^T, as `x @ W.T` with W [out, in] arrives):
 * each output element is a dot product of two contiguous rows, summed in 16 lanes, then the
 * lanes in order, then the tail. The 16 lanes are two named 8-lane halves: as one 16-wide
 * vector, GCC's AVX2 clone moved the sum through the stack in 16-byte pieces every step and
 * reloaded it whole (a stalled store forward each time: mlx-lm's [out, in] products of 2 to
 * 12 rows ran at 40% of the baseline clone's speed). */
static inline __attribute__((always_inline)) void nt_columns(int m, int k, const float *a, int lda, const float *b,
                                                             int ldb, float *acc, int ldacc, int j0, int j1) {
    for (int j = j0; j < j1; j++) {
        const float *wr = b + (long)j * ldb;
        for (int i = 0; i < m; i++) {
            const float *ai = a + (long)i * lda;
            v8 lo = {0}, hi = {0};
            int q = 0;
            for (; q + 16 <= k; q += 16) {
                v8 x0, x1, y0, y1;
                memcpy(&x0, wr + q, sizeof x0);
                memcpy(&x1, wr + q + 8, sizeof x1);
                memcpy(&y0, ai + q, sizeof y0);
                memcpy(&y1, ai + q + 8, sizeof y1);
                lo += x0 * y0;
                hi += x1 * y1;
            }
            float c = 0.0f;
            for (int l = 0; l < 8; l++) c += lo[l];
            for (int l = 0; l < 8; l++) c += hi[l];
            for (; q < k; q++) c += wr[q] * ai[q];
            acc[(long)i * ldacc + (j - j0)] = c;
        }
    }
}

/* Products of MaxFewRows + 1 to MaxPanelRows rows by a matrix stored [k][n] (a prefill of a
 * few dozen tokens by parity's [in, out] weights). OpenBLAS packs the whole weight matrix on
 * every call, and at these row counts the copy costs as much as the arithmetic: its time was
 * flat from 4 to 32 rows (ci/blas/bench_sgemm.c). Here each thread takes a run of columns and
 * walks it PanelK rows of the matrix at a time, in panels a few vectors wide: while a panel's
 * blocks of rows run, the next panel's weights are prefetched (a panel's rows are a matrix row
 * apart, too far apart for the hardware's prefetcher), and nothing is copied.
 *
 * Every output element is one fused multiply-add chain over k in order, from zero, held in C
 * between runs of PanelK (a float32 sum stored and loaded is the same float): its bits depend
 * on neither the panel width nor the block of rows nor the thread, so AVX-512 and AVX2 machines
 * compute the same floats, and a prompt's row gets the same sums next to any number of others in
 * that range. A CPU without FMA, and a call with alpha != 1 or beta != 0, stay OpenBLAS's. */
enum { MaxPanelRows = 64, PanelK = 64 };
#include <immintrin.h>

/* One column at a time: the tail of a run narrower than a vector. */
__attribute__((target("fma"))) static void panel_scalar(int m, int k, const float *a, int lda, const float *b,
                                                        int ldb, float *c, int ldc, int j0, int j1) {
    for (int j = j0; j < j1; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int q = 0; q < k; q++) s = __builtin_fmaf(a[(long)i * lda + q], b[(long)q * ldb + j], s);
            c[(long)i * ldc + j] = s;
        }
}

/* A block of R rows by V vectors of W lanes over B's rows [k0, k1), as a macro (VEC, LOAD,
 * STORE, FMA, SET1 name the ISA's operations) so that each ISA's function holds its own copy
 * with R and V known. */
#define PANEL_BLOCK(R, V, W, VEC, LOAD, STORE, FMA, SET1)                                                            \
    do {                                                                                                              \
        VEC acc[R][V];                                                                                                \
        for (int i = 0; i < (R); i++)                                                                                 \
            for (int v = 0; v < (V); v++)                                                                             \
                acc[i][v] = k0 == 0 ? SET1(0.0f) : LOAD(c + (long)(i0 + i) * ldc + j + v * (W));                     \
        for (int q = k0; q < k1; q++) {                                                                               \
            const float *bq = b + (long)q * ldb + j;                                                                  \
            VEC bv[V];                                                                                                \
            for (int v = 0; v < (V); v++) bv[v] = LOAD(bq + v * (W));                                                 \
            for (int i = 0; i < (R); i++) {                                                                           \
                VEC ai = SET1(a[(long)(i0 + i) * lda + q]);                                                           \
                for (int v = 0; v < (V); v++) acc[i][v] = FMA(ai, bv[v], acc[i][v]);                                  \
            }                                                                                                         \
        }                                                                                                             \
        for (int i = 0; i < (R); i++)                                                                                 \
            for (int v = 0; v < (V); v++) STORE(c + (long)(i0 + i) * ldc + j + v * (W), acc[i][v]);                   \
    } while (0)

/* The panel V vectors wide at column j over B's rows [k0, k1): first the next panel's weights
 * (the next columns, or the next run's first) are asked for in one burst (asked for a row a step
 * instead, the products ran slower), then the rows run, cut into as few blocks of at most MAXR
 * as hold them, of sizes differing by one at most (a block of one or two rows has too few
 * independent sums to keep the FMA units busy). */
#define PANEL(MAXR, V, W, VEC, LOAD, STORE, FMA, SET1)                                                                \
    do {                                                                                                              \
        int nj = j + (V) * (W), nk0 = k0;                                                                             \
        if (nj >= jv) nj = j0, nk0 = k1;                                                                             \
        const float *pf = b + (long)nk0 * ldb + nj;                                                                   \
        int pfn = nk0 < k ? (k - nk0 < PanelK ? k - nk0 : PanelK) : 0;                                               \
        for (int q = 0; q < pfn; q++)                                                                                 \
            for (int f = 0; f < (V) * (W); f += 16) _mm_prefetch((const char *)(pf + (long)q * ldb + f), _MM_HINT_T0); \
        int blocks = (m + (MAXR) - 1) / (MAXR);                                                                       \
        for (int bl = 0, i0 = 0; bl < blocks; bl++) {                                                                 \
            int r = m / blocks + (bl < m % blocks);                                                                   \
            switch (r) {                                                                                              \
            case 1: PANEL_BLOCK(1, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                        \
            case 2: PANEL_BLOCK(2, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                        \
            case 3: PANEL_BLOCK(3, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                        \
            case 4: PANEL_BLOCK(4, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                        \
            case 5: PANEL_BLOCK(5, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                        \
            case 6: PANEL_BLOCK(6, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                        \
            case 7: PANEL_BLOCK((MAXR) < 7 ? (MAXR) : 7, V, W, VEC, LOAD, STORE, FMA, SET1); break;                   \
            default: PANEL_BLOCK(MAXR, V, W, VEC, LOAD, STORE, FMA, SET1); break;                                    \
            }                                                                                                         \
            i0 += r;                                                                                                  \
        }                                                                                                             \
    } while (0)

/* Columns [j0, j1) in panels WIDE vectors wide, then one vector wide; the tail narrower than a
 * vector is summed column by column after them, as one chain over all of k (its partial sums
 * are not kept in C between runs). */
#define PANEL_ALL(MAXR, WIDE, W, VEC, LOAD, STORE, FMA, SET1)                                                         \
    int jv = j0 + (j1 - j0) / (W) * (W);                                                                              \
    for (int k0 = 0; k0 < k; k0 += PanelK) {                                                                          \
        int k1 = k0 + PanelK < k ? k0 + PanelK : k, j = j0;                                                           \
        for (; j + (WIDE) * (W) <= jv; j += (WIDE) * (W)) PANEL(MAXR, WIDE, W, VEC, LOAD, STORE, FMA, SET1);          \
        for (; j < jv; j += (W)) PANEL(MAXR, 1, W, VEC, LOAD, STORE, FMA, SET1);                                      \
    }                                                                                                                 \
    panel_scalar(m, k, a, lda, b, ldb, c, ldc, jv, j1)

/* AVX-512: blocks of up to 8 rows by 32 columns, 16 sums in registers of 32. */
__attribute__((target("avx512f,fma"))) static void panel_avx512(int m, int k, const float *a, int lda,
                                                                const float *b, int ldb, float *c, int ldc,
                                                                int j0, int j1) {
    PANEL_ALL(8, 2, 16, __m512, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps);
}

/* AVX2: blocks of up to 6 rows by 16 columns, 12 sums in registers of 16. */
__attribute__((target("avx2,fma"))) static void panel_avx2(int m, int k, const float *a, int lda, const float *b,
                                                           int ldb, float *c, int ldc, int j0, int j1) {
    PANEL_ALL(6, 2, 8, __m256, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps);
}

typedef void (*panel_fn)(int, int, const float *, int, const float *, int, float *, int, int, int);

/* Attention's products. MLX's CPU attention (the fallback of its fused one) multiplies each
 * head's queries by the head's keys, then the softmax by the values, one GEMM call a head: for
 * a decode step that is 1 row by [w, D] transposed, then 1 row by [w, D], 2 x B x heads calls a
 * layer (17,280 a step at batch 32 in SmolLM2). OpenBLAS packs both operands on every call and
 * the packing, not the arithmetic, took the time: 5-7 us a call, attention 35% of a batch-32
 * step. Products of up to TinyRows rows whose other operand is under MinForwardElements (no
 * weight matrix is: those have their own paths above) run here, on the calling thread, with
 * nothing copied.
 *
 * Each output element is one fused multiply-add chain over k in order from zero, as in the
 * panels: its bits depend on neither the row count nor the ISA, so a row's attention is the same
 * next to other heads' rows or alone. On AMD Zen that chain is also what OpenBLAS 0.3.21 computed
 * for 1 to 3 rows (past 3, and past its K block, it is not). */
enum { TinyRows = 8 };

/* Rows [i0, i0 + R) of C = A B^T for B's rows [j, j + 8), B^T's columns read eight at a time
 * and turned into eight vectors of one k each (an 8 x 8 transpose in registers). */
#define NT_BLOCK(R)                                                                                                   \
    do {                                                                                                              \
        __m256 acc[R];                                                                                                \
        for (int i = 0; i < (R); i++) acc[i] = _mm256_setzero_ps();                                                   \
        const float *bj = b + (long)j * ldb;                                                                          \
        int q = 0;                                                                                                    \
        for (; q + 8 <= k; q += 8) {                                                                                  \
            __m256 t[8];                                                                                              \
            transpose8(bj + q, ldb, t);                                                                               \
            for (int x = 0; x < 8; x++)                                                                               \
                for (int i = 0; i < (R); i++)                                                                         \
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(a[(long)(i0 + i) * lda + q + x]), t[x], acc[i]);         \
        }                                                                                                             \
        for (; q < k; q++) {                                                                                          \
            __m256 t = _mm256_set_ps(bj[7L * ldb + q], bj[6L * ldb + q], bj[5L * ldb + q], bj[4L * ldb + q],          \
                                     bj[3L * ldb + q], bj[2L * ldb + q], bj[(long)ldb + q], bj[q]);                   \
            for (int i = 0; i < (R); i++)                                                                             \
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(a[(long)(i0 + i) * lda + q]), t, acc[i]);                      \
        }                                                                                                             \
        for (int i = 0; i < (R); i++) _mm256_storeu_ps(c + (long)(i0 + i) * ldc + j, acc[i]);                         \
    } while (0)

/* t[x] = the eight floats at column x of the 8 x 8 block at p (rows ld apart). */
__attribute__((target("avx2,fma"), always_inline)) static inline void transpose8(const float *p, int ld, __m256 *t) {
    __m256 r0 = _mm256_loadu_ps(p), r1 = _mm256_loadu_ps(p + ld), r2 = _mm256_loadu_ps(p + 2L * ld),
           r3 = _mm256_loadu_ps(p + 3L * ld), r4 = _mm256_loadu_ps(p + 4L * ld), r5 = _mm256_loadu_ps(p + 5L * ld),
           r6 = _mm256_loadu_ps(p + 6L * ld), r7 = _mm256_loadu_ps(p + 7L * ld);
    __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1), u2 = _mm256_unpacklo_ps(r2, r3),
           u3 = _mm256_unpackhi_ps(r2, r3), u4 = _mm256_unpacklo_ps(r4, r5), u5 = _mm256_unpackhi_ps(r4, r5),
           u6 = _mm256_unpacklo_ps(r6, r7), u7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE),
           s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE),
           s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE),
           s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
    t[0] = _mm256_permute2f128_ps(s0, s4, 0x20), t[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    t[2] = _mm256_permute2f128_ps(s2, s6, 0x20), t[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    t[4] = _mm256_permute2f128_ps(s0, s4, 0x31), t[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    t[6] = _mm256_permute2f128_ps(s2, s6, 0x31), t[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* C (m x n) = A (m x k) B^T, B stored [n][k]: the scores of m queries against n keys. Rows in
 * as few blocks of at most four as hold them, of sizes differing by one at most (four sums and
 * eight columns of B in registers of 16; five rows as 3 + 2, not 4 + 1, as the panels cut
 * theirs), B's rows eight at a time; the last fewer than eight one by one. */
__attribute__((target("avx2,fma"))) static void tiny_nt(int m, int k, const float *a, int lda, const float *b,
                                                        int ldb, float *c, int ldc, int n) {
    int blocks = (m + 3) / 4, j = 0;
    for (; j + 8 <= n; j += 8)
        for (int bl = 0, i0 = 0; bl < blocks; bl++) {
            int r = m / blocks + (bl < m % blocks);
            switch (r) {
            case 1: NT_BLOCK(1); break;
            case 2: NT_BLOCK(2); break;
            case 3: NT_BLOCK(3); break;
            default: NT_BLOCK(4); break;
            }
            i0 += r;
        }
    for (; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int q = 0; q < k; q++) s = __builtin_fmaf(a[(long)i * lda + q], b[(long)j * ldb + q], s);
            c[(long)i * ldc + j] = s;
        }
}

/* What this CPU runs, found once (every product thread asks): the panel kernel (NULL without
 * FMA: OpenBLAS keeps those products), and whether the twins' kernel runs 16-lane vectors
 * (AVX-512; elsewhere they would be split in halves, and an AVX2 clone spilled such sums
 * through the stack, see nt_columns). */
static struct {
    panel_fn panel;
    int twin_wide;
    int tiny; /* tiny_nt and the panels run attention's products (AVX2 and FMA) */
} cpu;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;
static void find_cpu(void) {
    __builtin_cpu_init();
    int avx512 = !!__builtin_cpu_supports("avx512f"), fma = !!__builtin_cpu_supports("fma");
    cpu.twin_wide = avx512;
    cpu.panel = !fma ? NULL : avx512 ? panel_avx512 : __builtin_cpu_supports("avx2") ? panel_avx2 : NULL;
    cpu.tiny = fma && __builtin_cpu_supports("avx2");
}
static panel_fn panel_kernel(void) {
    pthread_once(&cpu_once, find_cpu);
    return cpu.panel;
}
static int tiny_kernels(void) {
    pthread_once(&cpu_once, find_cpu);
    return cpu.tiny;
}
static int twin_wide(void) {
    pthread_once(&cpu_once, find_cpu);
    return cpu.twin_wide;
}

/* Attention over a paged cache's rows where they lie (src/model/attention/in_place.rs). MLX's
 * CPU attention over a paged cache needs the rows of every sequence gathered into one copy a
 * layer (K and V, every step), and at batch 32 that copy was a quarter of a decode step. These
 * two products read the rows from the cache's store instead, key j of a sequence at
 * base + rows[j] * ldb, and compute what the tiny kernels above compute over the copy: every
 * output element one fused multiply-add chain over k in order from zero. So the result is the
 * copy's product to the bit, and only where parity_rows_chains() says the copy's products would
 * run here (alpha 1, beta 0, at most TinyRows rows, under MinForwardElements: the caller
 * checks the sizes). */
int parity_rows_chains(void) { return parity_gemv_forward() && tiny_kernels(); }

/* C (m x n) = A (m x k) B^T, B's row j at base + rows[j] * ldb: tiny_nt over each run of
 * consecutive rows (a block of the cache is one). A row read again as the first (a short
 * sequence's padding) is the first column again: the same chain over the same numbers. */
void parity_rows_scores(int m, int k, const float *a, int lda, const float *base, int ldb, const int *rows, int n,
                        float *c, int ldc) {
    for (int j = 0; j < n;) {
        if (j > 0 && rows[j] == rows[0]) {
            for (int i = 0; i < m; i++) c[(long)i * ldc + j] = c[(long)i * ldc];
            j++;
            continue;
        }
        int e = j + 1;
        while (e < n && rows[e] == rows[e - 1] + 1) e++;
        tiny_nt(m, k, a, lda, base + (long)rows[j] * ldb, ldb, c + j, ldc, e - j);
        j = e;
    }
}

/* Rows [i0, i0 + R) by columns [j, j + RowsCols) of C = A B over B's rows rows[0..k): the sums
 * in registers over all of k (GCC unrolls the constant loops and keeps acc out of memory). */
enum { RowsCols = 64 };
#define ROWS_BLOCK(R)                                                                                                \
    do {                                                                                                              \
        float acc[R][RowsCols];                                                                                       \
        for (int i = 0; i < (R); i++)                                                                                 \
            for (int x = 0; x < RowsCols; x++) acc[i][x] = 0.0f;                                                      \
        for (int q = 0; q < k; q++) {                                                                                 \
            const float *bq = base + (long)rows[q] * ldb + j;                                                         \
            for (int i = 0; i < (R); i++) {                                                                           \
                float p = a[(long)(i0 + i) * lda + q];                                                                \
                for (int x = 0; x < RowsCols; x++) acc[i][x] = __builtin_fmaf(p, bq[x], acc[i][x]);                 \
            }                                                                                                         \
        }                                                                                                             \
        for (int i = 0; i < (R); i++)                                                                                 \
            for (int x = 0; x < RowsCols; x++) c[(long)(i0 + i) * ldc + j + x] = acc[i][x];                         \
    } while (0)

/* C (m x n) = A (m x k) B, B's row q at base + rows[q] * ldb: each element one chain over q in
 * order from zero, as the panels sum (an FMA is exact before its one rounding, so the vector
 * width the compiler picks moves no bit). Rows in blocks of up to four by 64 columns; columns
 * past the last whole 64 one chain at a time. */
__attribute__((target_clones("avx512f", "avx2", "default"))) void parity_rows_values(
    int m, int k, const float *a, int lda, const float *base, int ldb, const int *rows, int n, float *c, int ldc) {
    int jv = n / RowsCols * RowsCols;
    for (int j = 0; j < jv; j += RowsCols)
        for (int i0 = 0; i0 < m;) {
            int r = m - i0 < 4 ? m - i0 : 4;
            switch (r) {
            case 1: ROWS_BLOCK(1); break;
            case 2: ROWS_BLOCK(2); break;
            case 3: ROWS_BLOCK(3); break;
            default: ROWS_BLOCK(4); break;
            }
            i0 += r;
        }
    for (int i = 0; i < m; i++)
        for (int j = jv; j < n; j++) {
            float s = 0.0f;
            for (int q = 0; q < k; q++) s = __builtin_fmaf(a[(long)i * lda + q], base[(long)rows[q] * ldb + j], s);
            c[(long)i * ldc + j] = s;
        }
}

/* Products of 1 to MaxFewRows rows by a matrix stored [k][n] (parity's [in, out] weights) are
 * split along K, not the columns: K is cut into KChunks runs of whole rows (multiples of 16,
 * fixed by k alone), each summed from zero in k's order into a partial output, and the
 * partials are added in run order. Threads take whole runs, so each streams whole rows:
 * splitting the columns left each of two threads a 1152-byte piece of every 2304-byte row of
 * SmolLM2's o and down matrices. The runs depend on neither the thread count nor m, so a row's
 * sums are the same on any number of cores and next to 0 to 11 other rows. */
enum { KChunks = 8 };
static int chunk_start(int k, int c) { return c == KChunks ? k : (int)((long)k * c / KChunks) / 16 * 16; }

/* Packed twins. A checkpoint quantized to a few bits and dequantized at load (parity computes in
 * float32: MLX's CPU quantized matmul runs on one thread) has every float32 weight equal to
 * scale * q + bias for a small integer q. A decode step at batch 1 reads all of those floats;
 * the packed form is 5 to 6 bits a weight, not 32. parity registers the packed form of such a
 * matrix as the matrix's twin (parity_twin_packed), and a K-split product of up to TwinMaxRows
 * rows by the matrix then reads the twin and computes every weight in registers. Each weight comes out the float it
 * stands for (registration compares every one of them, bit for bit, with the float32 matrix,
 * and refuses a twin that differs in any), and each sum is the same float sequence in the same
 * order as nn_run's, so a product's bits do not change: only the bytes read do.
 *
 * Layout: the packed words transposed to [k / per_word][n] (per_word = 32 / bits weights of
 * one column a word) and scales and biases to [k / group][n], so a run of K rows is read as
 * contiguous rows, as nn_run reads the float32 matrix. */
typedef struct {
    const float *b; /* the float32 matrix [k][n] this twin stands for: the key */
    int k, n, group, bits;
    uint32_t *words;
    float *scales, *biases;
    atomic_int users; /* calls reading the twin now: dropping it waits for them */
} Twin;

/* Up to this many rows read a twin; more read the float32 matrix. The twin kernel is bound by
 * arithmetic, not by the bytes it reads (each weight made from its word, then a multiply and an
 * add a row): in 8-wide AVX2 one to four rows decode faster from the twin than from the floats,
 * in the SSE2 baseline only one did (see docs/benchmarks.md). */
enum { TwinMaxRows = 4 };

/* Weight `s` of each of a vector's columns' `word` (VI, VF: int and float vectors of its lanes;
 * TWIN_WEIGHT: 8 lanes): the products and the check below both compute it here, so what the
 * check compares is what the products multiply. (A macro: a function taking or returning AVX
 * vectors is not one ABI across the clones.) */
#define TWIN_WEIGHT_OF(VI, VF, BITS, word, s, sc, bi)                                                             \
    ((sc) * __builtin_convertvector((VI)(((word) >> (unsigned)((BITS) * (s))) & ((1u << (BITS)) - 1)), VF) + (bi))
#define TWIN_WEIGHT(BITS, word, s, sc, bi) TWIN_WEIGHT_OF(i8v, v8, BITS, word, s, sc, bi)

/* The weight at row k, column j, for columns past the last whole 8. */
static inline __attribute__((always_inline)) float twin_weight1(const Twin *t, int k, int j) {
    int per = 32 / t->bits;
    unsigned word = t->words[(long)(k / per) * t->n + j];
    float q = (float)(int)((word >> (unsigned)(t->bits * (k % per))) & ((1u << t->bits) - 1));
    return t->scales[(long)(k / t->group) * t->n + j] * q + t->biases[(long)(k / t->group) * t->n + j];
}

/* How far ahead (in words, scales and biases: 4 KiB) each step asks for its streams. At batch 1
 * perf put half of the twins' kernel on its first load of a block's words, a wait for memory:
 * the hardware prefetchers did not keep four streams a thread far enough ahead. Asked for 4 KiB
 * ahead, B=1 decode went 46 -> 70 tok/s on a 2-core Xeon (docs/benchmarks.md). Prefetches
 * never fault, so reading past a twin's end is harmless. */
enum { TwinAhead = 1024 };
/* Columns [from, to) of one word's rows in vectors of L lanes (VF, VU, VI: float, unsigned and
 * int vectors of L lanes). Named sums, not an array: an array of vectors went through the
 * stack, and the reload of a sum stored in halves stalled every column block. */
#define TWIN_COLUMNS(VF, VU, VI, L, from, to)                                                                         \
    for (int j = (from); j < (to); j += (L)) {                                                                        \
        VU word;                                                                                                      \
        VF sc, bi, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};                                                            \
        __builtin_prefetch(words + j + TwinAhead, 0, 3);                                                              \
        __builtin_prefetch(scales + j + TwinAhead, 0, 3);                                                             \
        __builtin_prefetch(biases + j + TwinAhead, 0, 3);                                                             \
        memcpy(&word, words + j, sizeof word);                                                                        \
        memcpy(&sc, scales + j, sizeof sc);                                                                           \
        memcpy(&bi, biases + j, sizeof bi);                                                                           \
        if (k > k0) {                                                                                                 \
            memcpy(&c0, out0 + j, sizeof c0);                                                                         \
            if (M > 1) memcpy(&c1, out1 + j, sizeof c1);                                                              \
            if (M > 2) memcpy(&c2, out2 + j, sizeof c2);                                                              \
            if (M > 3) memcpy(&c3, out3 + j, sizeof c3);                                                              \
        }                                                                                                             \
        _Pragma("GCC unroll 16") for (int s = 0; s < per; s++) {                                                      \
            VF w = TWIN_WEIGHT_OF(VI, VF, BITS, word, s, sc, bi);                                                     \
            c0 += x0[s] * w;                                                                                          \
            if (M > 1) c1 += x1[s] * w;                                                                               \
            if (M > 2) c2 += x2[s] * w;                                                                               \
            if (M > 3) c3 += x3[s] * w;                                                                               \
        }                                                                                                             \
        memcpy(out0 + j, &c0, sizeof c0);                                                                             \
        if (M > 1) memcpy(out1 + j, &c1, sizeof c1);                                                                  \
        if (M > 2) memcpy(out2 + j, &c2, sizeof c2);                                                                  \
        if (M > 3) memcpy(out3 + j, &c3, sizeof c3);                                                                  \
    }

/* acc (M x n) = A B over B's rows [k0, k1), for M of 1 to TwinMaxRows, B read from its twin a
 * word's rows at a time (per_word rows of B), every column of them, as nn_run reads KRows rows
 * of floats: the twin is read in a few sequential streams. (Going down a block of columns
 * through all of a run's rows instead jumps a twin row ahead each word, a stream for every row,
 * more than the prefetchers follow: half the speed.) Each weight is computed in registers and
 * used for every row of A at once; each output element is summed from zero in k's order, one
 * product at a time, exactly as nn_run sums it, so the lanes a vector holds (16 with WIDE, on
 * an AVX-512 core, else 8) change no sum. k0 and k1 are multiples of the weights a word holds
 * (runs start at multiples of 16, and a twin's k is one), and a word never spans two groups. */
static inline __attribute__((always_inline)) void twin_rows(const int M, const int BITS, const int WIDE, int k0,
                                                             int k1, const float *a, int lda, const Twin *t,
                                                             float *acc, int n) {
    const int per = 32 / BITS;
    int wide = WIDE ? n / 16 * 16 : 0, whole = n / 8 * 8;
    float *out0 = acc, *out1 = acc + (M > 1 ? n : 0), *out2 = acc + (M > 2 ? 2 * n : 0),
          *out3 = acc + (M > 3 ? 3 * n : 0);
    for (int k = k0; k < k1; k += per) {
        const uint32_t *words = t->words + (long)(k / per) * n;
        const float *scales = t->scales + (long)(k / t->group) * n, *biases = t->biases + (scales - t->scales);
        const float *x0 = a + k, *x1 = a + (M > 1 ? lda : 0) + k, *x2 = a + (M > 2 ? 2 * lda : 0) + k,
                    *x3 = a + (M > 3 ? 3 * lda : 0) + k;
        if (WIDE) TWIN_COLUMNS(v16, u16v, i16v, 16, 0, wide)
        TWIN_COLUMNS(v8, u8v, i8v, 8, wide, whole)
        for (int j = whole; j < n; j++)
            for (int i = 0; i < M; i++) {
                float c = k > k0 ? acc[(long)i * n + j] : 0.0f;
                for (int s = 0; s < per; s++) c += a[(long)i * lda + k + s] * twin_weight1(t, k + s, j);
                acc[(long)i * n + j] = c;
            }
    }
}

static inline __attribute__((always_inline)) void nn_run_twin_bits(const int BITS, int m, int k0, int k1,
                                                                    const float *a, int lda, const Twin *t,
                                                                    float *acc, int n) {
    /* The row count alone selects the row kernel: folding the flag into the same switch
     * (m * 2 + wide) turns a "true" other than 1 (__builtin_cpu_supports returns a mask) into
     * more rows than A has, and the kernel writes past the output. */
    if (twin_wide()) {
        switch (m) {
        case 1: twin_rows(1, BITS, 1, k0, k1, a, lda, t, acc, n); break;
        case 2: twin_rows(2, BITS, 1, k0, k1, a, lda, t, acc, n); break;
        case 3: twin_rows(3, BITS, 1, k0, k1, a, lda, t, acc, n); break;
        default: twin_rows(4, BITS, 1, k0, k1, a, lda, t, acc, n); break;
        }
    } else {
        switch (m) {
        case 1: twin_rows(1, BITS, 0, k0, k1, a, lda, t, acc, n); break;
        case 2: twin_rows(2, BITS, 0, k0, k1, a, lda, t, acc, n); break;
        case 3: twin_rows(3, BITS, 0, k0, k1, a, lda, t, acc, n); break;
        default: twin_rows(4, BITS, 0, k0, k1, a, lda, t, acc, n); break;
        }
    }
}

/* acc (m x n, m <= TwinMaxRows) = A B over B's rows [k0, k1), B read from its twin. */
static inline __attribute__((always_inline)) void nn_run_twin(int m, int k0, int k1, const float *a, int lda,
                                                               const Twin *t, float *acc, int n) {
    switch (t->bits) {
    case 2: nn_run_twin_bits(2, m, k0, k1, a, lda, t, acc, n); break;
    case 4: nn_run_twin_bits(4, m, k0, k1, a, lda, t, acc, n); break;
    default: nn_run_twin_bits(8, m, k0, k1, a, lda, t, acc, n); break;
    }
}

static inline __attribute__((always_inline)) int twin_matches_bits(const int BITS, const Twin *t) {
    const int per = 32 / BITS;
    int j = 0;
    for (; j + 8 <= t->n; j += 8)
        for (int k = 0; k < t->k; k += per) {
            u8v word;
            v8 sc, bi;
            memcpy(&word, t->words + (long)(k / per) * t->n + j, sizeof word);
            memcpy(&sc, t->scales + (long)(k / t->group) * t->n + j, sizeof sc);
            memcpy(&bi, t->biases + (long)(k / t->group) * t->n + j, sizeof bi);
            for (int s = 0; s < per; s++) {
                v8 w = TWIN_WEIGHT(BITS, word, s, sc, bi);
                if (memcmp(&w, t->b + (long)(k + s) * t->n + j, sizeof w)) return 0;
            }
        }
    for (; j < t->n; j++)
        for (int k = 0; k < t->k; k++) {
            float v = twin_weight1(t, k, j);
            if (memcmp(&v, t->b + (long)k * t->n + j, sizeof v)) return 0;
        }
    return 1;
}

/* Whether every weight of the twin is the float32 matrix's, bit for bit, computed by the code
 * the products run (compiled for the same CPU). */
__attribute__((target_clones("avx512f", "avx2", "default"))) static int twin_matches(const Twin *t) {
    switch (t->bits) {
    case 2: return twin_matches_bits(2, t);
    case 4: return twin_matches_bits(4, t);
    default: return twin_matches_bits(8, t);
    }
}

/* Whether the twin's sums are the float kernel's, bit for bit, on this CPU's build: rows of
 * fixed values (1 to TwinMaxRows) over every run of K, through nn_run and through the twin. The
 * weights alone being equal is not enough: the two kernels are separate code, and a build that
 * fused a multiply and add in one and not the other (a compiler contracting nn_run's 16-wide
 * sums where it has no FMA for the twin's 8-wide ones) would sum the same weights to other
 * bits. A twin whose sums differ here is refused: speed is given up, bits are not. */
__attribute__((target_clones("avx512f", "avx2", "default"))) static int twin_sums_match(const Twin *t) {
    int ok = 1;
    float *x = malloc(sizeof(float) * TwinMaxRows * (size_t)t->k),
          *p = malloc(sizeof(float) * TwinMaxRows * (size_t)t->n), *q = malloc(sizeof(float) * TwinMaxRows * (size_t)t->n);
    if (!x || !p || !q) ok = 0;
    unsigned r = 12345u;
    for (int i = 0; ok && i < TwinMaxRows * t->k; i++) {
        r = r * 1664525u + 1013904223u;
        x[i] = (float)(int)(r >> 8) / (float)(1 << 23) - 1.0f;
    }
    for (int m = 1; ok && m <= TwinMaxRows; m++)
        for (int c = 0; ok && c < KChunks; c++) {
            int k0 = chunk_start(t->k, c), k1 = chunk_start(t->k, c + 1);
            if (k1 <= k0) continue;
            nn_run(m, k1 - k0, x + k0, t->k, t->b + (long)k0 * t->n, t->n, p, t->n);
            nn_run_twin(m, k0, k1, x, t->k, t, q, t->n);
            ok = memcmp(p, q, sizeof(float) * (size_t)m * (size_t)t->n) == 0;
        }
    free(x);
    free(p);
    free(q);
    return ok;
}

/* Twins by their float32 matrix: open addressing, looked up without a lock by every product,
 * changed under `twins_lock` at load and drop. A dropped entry becomes `Gone`, so later keys
 * of its probe chain are still found. */
enum { TwinSlots = 4096 };
static Twin gone;
#define Gone (&gone)
static _Atomic(Twin *) twins[TwinSlots];
static pthread_mutex_t twins_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int twins_live;

static unsigned twin_slot(const float *b) { return (unsigned)(((unsigned long)b >> 6) * 2654435761u) % TwinSlots; }

/* The twin of `b` as a [k][n] matrix with rows n apart, held for a call (twin_release after),
 * or NULL. */
static Twin *twin_acquire(const float *b, int k, int n, int ldb) {
    if (!atomic_load_explicit(&twins_live, memory_order_relaxed) || ldb != n) return NULL;
    /* k == n == 0: whatever its shape (a question, not a product). */
    int any = k == 0 && n == 0;
    unsigned s = twin_slot(b);
    for (unsigned i = 0; i < TwinSlots; i++) {
        Twin *t = atomic_load(&twins[(s + i) % TwinSlots]);
        if (!t) return NULL;
        if (t == Gone || t->b != b) continue;
        if (!any && (t->k != k || t->n != n)) return NULL;
        atomic_fetch_add(&t->users, 1);
        /* Dropped between the load and the count: not ours to read. */
        if (atomic_load(&twins[(s + i) % TwinSlots]) != t) {
            atomic_fetch_sub(&t->users, 1);
            return NULL;
        }
        return t;
    }
    return NULL;
}

static void twin_release(Twin *t) {
    if (t) atomic_fetch_sub(&t->users, 1);
}

static void twin_free(Twin *t) {
    if (!t) return;
    free(t->words);
    free(t->scales);
    free(t->biases);
    free(t);
}

static Twin *twin_alloc(const float *b, int k, int n, int group, int bits) {
    if (k <= 0 || n <= 0 || !(bits == 2 || bits == 4 || bits == 8) || group <= 0 || group % (32 / bits) ||
        k % group || k % 16)
        return NULL;
    Twin *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    *t = (Twin){.b = b, .k = k, .n = n, .group = group, .bits = bits};
    t->words = malloc(sizeof(uint32_t) * (size_t)(k / (32 / bits)) * (size_t)n);
    t->scales = malloc(sizeof(float) * (size_t)(k / group) * (size_t)n);
    t->biases = malloc(sizeof(float) * (size_t)(k / group) * (size_t)n);
    if (!t->words || !t->scales || !t->biases) {
        twin_free(t);
        return NULL;
    }
    return t;
}

/* Verify `t` and publish it; on any refusal it is freed. Returns 1 when published. */
static int twin_publish(Twin *t) {
    if (!twin_matches(t) || !twin_sums_match(t)) {
        twin_free(t);
        return 0;
    }
    pthread_mutex_lock(&twins_lock);
    unsigned s = twin_slot(t->b);
    int done = 0, free_slot = -1;
    /* The whole probe chain first: one twin a matrix (a second, behind a dropped entry, would
     * outlive the drop of the first and stand for whatever array comes to live there). */
    for (unsigned i = 0; i < TwinSlots; i++) {
        Twin *old = atomic_load(&twins[(s + i) % TwinSlots]);
        if (old && old != Gone && old->b == t->b) {
            free_slot = -1;
            break;
        }
        if ((!old || old == Gone) && free_slot < 0) free_slot = (int)((s + i) % TwinSlots);
        if (!old) break;
    }
    if (free_slot >= 0) {
        atomic_store(&twins[free_slot], t);
        atomic_fetch_add(&twins_live, 1);
        done = 1;
    }
    pthread_mutex_unlock(&twins_lock);
    if (!done) twin_free(t);
    return done;
}

/* 1 unless PARITY_PACKED_TWINS=0 (read once): with 0 no twin is registered, and the same
 * process reads the float32 matrices, for measuring one against the other. */
static int parity_twins_on(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("PARITY_PACKED_TWINS");
        on = !(v && strcmp(v, "0") == 0);
    }
    return on;
}

/* Register the packed form of the float32 matrix `b` ([k][n], rows n apart): MLX's affine
 * layout of its transpose, `packed` [n][k * bits / 32] words (weight k of column j in bits
 * (k % per_word) * bits up of word k / per_word), `scales` and `biases` [n][k / group].
 * Everything is copied. Returns 1 when every weight matched and the twin is in use, 0 when it
 * is refused (then products read `b` as before). */
int parity_twin_packed(const float *b, int k, int n, const uint32_t *packed, const float *scales,
                       const float *biases, int group, int bits) {
    if (!b || !packed || !scales || !biases || !parity_twins_on()) return 0;
    Twin *t = twin_alloc(b, k, n, group, bits);
    if (!t) return 0;
    int per = 32 / bits, wpr = k / per, gpr = k / group;
    for (int j = 0; j < n; j++) {
        for (int w = 0; w < wpr; w++) t->words[(long)w * n + j] = packed[(long)j * wpr + w];
        for (int g = 0; g < gpr; g++) {
            t->scales[(long)g * n + j] = scales[(long)j * gpr + g];
            t->biases[(long)g * n + j] = biases[(long)j * gpr + g];
        }
    }
    return twin_publish(t);
}

/* Unregister the twin of `b` (before `b` is freed: another matrix may come to live at its
 * address), once no product reads it. */
void parity_twin_drop(const float *b) {
    Twin *found = NULL;
    pthread_mutex_lock(&twins_lock);
    unsigned s = twin_slot(b);
    for (unsigned i = 0; i < TwinSlots; i++) {
        Twin *t = atomic_load(&twins[(s + i) % TwinSlots]);
        if (!t) break;
        if (t != Gone && t->b == b) {
            atomic_store(&twins[(s + i) % TwinSlots], Gone);
            atomic_fetch_sub(&twins_live, 1);
            found = t;
            break;
        }
    }
    pthread_mutex_unlock(&twins_lock);
    if (!found) return;
    while (atomic_load(&found->users) != 0) sched_yield();
    twin_free(found);
}

/* Whether `b` has a twin in use (tests: a product they compare really ran over a twin, and a
 * dropped twin is gone). */
int parity_twin_of(const float *b) {
    Twin *t = twin_acquire(b, 0, 0, 0);
    twin_release(t);
    return t != NULL;
}

/* Products of up to this many rows read a twin (a benchmark counts the bytes a step reads). */
int parity_twin_max_rows(void) { return TwinMaxRows; }

/* What a report's environment says of this file (src/environment.rs and ci/bench_mlx_lm.py
 * read it): a baseline measured with other forwarding is refused against this one. */
static char shim_label[512];
static void label_shim(void) {
    /* The clone the kernels run: target_clones picks the first one the CPU supports. */
    __builtin_cpu_init();
    char twins[64];
    snprintf(twins, sizeof twins, "dequantized weights of 1-%d rows read from packed twins", TwinMaxRows);
    const char *isa = __builtin_cpu_supports("avx512f") ? "AVX-512" : __builtin_cpu_supports("avx2") ? "AVX2" : "SSE2";
    snprintf(shim_label, sizeof shim_label,
             "1-12-row GEMM reading the weights once, split K in 8 runs by [in, out] weights and prefetched, %s, "
             "%s, %s, other one-row GEMM as GEMV; %s kernels",
             parity_twins_on() ? twins : "packed twins off",
             panel_kernel() ? "13-64-row GEMM by [in, out] weights in unpacked FMA panels" : "13-64 rows OpenBLAS's (no FMA)",
             tiny_kernels() ? "1-8-row GEMM by operands under 64 Ki elements (attention's) in one FMA chain each"
                            : "small GEMM OpenBLAS's",
             isa);
}
const char *parity_blas_shim(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!parity_gemv_forward()) return "GEMM forwarding off";
    pthread_once(&once, label_shim);
    return shim_label;
}

/* C (m x n, ldc) = alpha A op(B) + beta C, A's rows contiguous; `scratch` (m x n) holds the
 * sums when beta != 0 (beta == 0 must not read C, see gemv above: then C itself holds them).
 * With `partials` (KChunks x m x n), the job is split K as above: parts fill the partials and
 * the caller adds them. */
typedef struct {
    int m, n, k, lda, ldb, ldc, parts;
    float alpha, beta;
    const float *a, *b;
    float *c, *scratch, *partials;
    /* B's packed twin, read instead of B (K-split jobs only). */
    const Twin *twin;
    /* A panel job (see panel_kernel): parts run it over their columns. */
    panel_fn panel;
    /* A K-split job's runs are claimed, not dealt: the caller takes them from the front, the
     * workers from the back, each run once (`claimed`, a bit a run), so a worker that finds
     * its runs already in cache finishes them and takes more. */
    atomic_int *front, *back;
    atomic_uint *claimed;
} Job;

/* Part `t` of `parts` of a job (0 is the caller's): of a K-split job, the runs it claims; of
 * another, a run of the output's columns, a multiple of 16 wide. Compiled for AVX-512, AVX2 and
 * the baseline, chosen at load by the CPU's features. Not by its model: GCC 12 picks an
 * "arch=haswell" clone only on Intel's Haswell-family models, so an AMD Zen or a newer Intel
 * core without AVX-512 ran the SSE2 baseline, half the vector width. Every clone is built
 * without contraction (-ffp-contract=off, ci/blas.sh), so each multiply and add rounds as in
 * the baseline: a sum's bits are the same whichever clone, and whichever part, computes it, and
 * a twin's weights are MLX's (scale * q, rounded, + bias, rounded; a clone fusing them into an
 * FMA had every twin refused). */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void part(const Job *j, int t) {
    /* A side stops at the first run the other side claimed: past it, all are the other's. */
    while (j->partials) {
        int c = t == 0 ? atomic_fetch_add(j->front, 1) : atomic_fetch_sub(j->back, 1);
        if (c < 0 || c >= KChunks || (atomic_fetch_or(j->claimed, 1u << c) & (1u << c))) return;
        int k0 = chunk_start(j->k, c), k1 = chunk_start(j->k, c + 1);
        if (k1 > k0 && j->twin)
            nn_run_twin(j->m, k0, k1, j->a, j->lda, j->twin, j->partials + (long)c * j->m * j->n, j->n);
        else if (k1 > k0)
            nn_run(j->m, k1 - k0, j->a + k0, j->lda, j->b + (long)k0 * j->ldb, j->ldb,
                   j->partials + (long)c * j->m * j->n, j->n);
    }
    int per = ((j->n + j->parts - 1) / j->parts + 15) & ~15;
    int j0 = t * per < j->n ? t * per : j->n, j1 = j0 + per < j->n ? j0 + per : j->n;
    if (j->panel) {
        if (j1 > j0) j->panel(j->m, j->k, j->a, j->lda, j->b, j->ldb, j->c, j->ldc, j0, j1);
        return;
    }
    int width = j1 - j0, ldacc = j->scratch ? j->n : j->ldc;
    float *acc = (j->scratch ? j->scratch : j->c) + j0;
    if (width <= 0) return;
    nt_columns(j->m, j->k, j->a, j->lda, j->b, j->ldb, acc, ldacc, j0, j1);
    for (int i = 0; i < j->m; i++)
        for (int q = 0; q < width; q++) {
            float *o = j->c + (long)i * j->ldc + j0 + q;
            float p = acc[(long)i * ldacc + q];
            *o = j->beta == 0.0f ? j->alpha * p : j->alpha * p + j->beta * *o;
        }
}

/* The workers that run parts 1.. of a job while the caller runs part 0: as many threads in all
 * as OpenBLAS runs (OPENBLAS_NUM_THREADS holds both). Between jobs a worker spins, yielding
 * the core often, as OpenBLAS's own threads do, then sleeps. OpenMP's wait, which spins long
 * without yielding, made two processes running these products at once (parallel tests, two
 * suites) 40x slower each: every call waited out the other's time slice. */
enum { SpinYields = 2000, PausesPerYield = 64 };

/* Wait a while until `*v != not` (or, given `count`, until `*count == 0`): 64 pause
 * instructions between looks, a sched_yield after each batch of them (so another runnable
 * thread gets the core at once). Returns whether the wait ended. */
static int spin_wait(atomic_uint *v, unsigned not, atomic_int *count) {
    for (int y = 0; y < SpinYields; y++) {
        for (int i = 0; i < PausesPerYield; i++) {
            if (count ? atomic_load(count) == 0 : atomic_load(v) != not) return 1;
            __builtin_ia32_pause();
        }
        sched_yield();
    }
    return 0;
}
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    Job job;
    atomic_uint generation; /* bumped for every job handed to the workers */
    atomic_int pending;     /* workers yet to finish the current job */
    int workers;
    pid_t owner; /* a forked child has none of these threads: it runs every part itself */
    /* Held by the caller whose job the workers run: a second thread calling meanwhile (two
     * MLX streams, or a test harness's threads) runs its own parts itself. */
    pthread_mutex_t busy;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          .busy = PTHREAD_MUTEX_INITIALIZER};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* Which weight matrix followed which in K-split calls: a decode step multiplies by the same
 * matrices in the same order every step, so while the caller's thread runs the small operations
 * between two products (norms, RoPE, attention: a quarter of a batch-1 step, with the memory
 * bus idle), a worker pulls the back runs of the next matrix into its cache. Only prefetch
 * instructions touch it: they never fault, so a stale entry (a matrix since freed) costs
 * nothing, and no sum changes. */
enum { NextSlots = 1024, PrefetchBytes = 3 << 19 };
static struct {
    _Atomic(const float *) from, to;
    atomic_int k, n, ldb;
} next_of[NextSlots];
static _Thread_local const float *last_b;

static unsigned slot_of(const float *b) { return (unsigned)(((unsigned long)b >> 6) * 2654435761u) % NextSlots; }

static void record_next(const Job *j) {
    if (last_b && last_b != j->b) {
        unsigned s = slot_of(last_b);
        atomic_store_explicit(&next_of[s].from, last_b, memory_order_relaxed);
        atomic_store_explicit(&next_of[s].to, j->b, memory_order_relaxed);
        atomic_store_explicit(&next_of[s].k, j->k, memory_order_relaxed);
        atomic_store_explicit(&next_of[s].n, j->n, memory_order_relaxed);
        atomic_store_explicit(&next_of[s].ldb, j->ldb, memory_order_relaxed);
    }
    last_b = j->b;
}

static void prefetch_after(const float *b, unsigned seen, int m);

static void *worker(void *arg) {
    int id = (int)(long)arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g = seen;
        if (spin_wait(&pool.generation, seen, NULL)) g = atomic_load(&pool.generation);
        if (g == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((g = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = g;
        const float *b = pool.job.partials ? pool.job.b : NULL;
        int m = pool.job.m;
        if (id < pool.job.parts) part(&pool.job, id);
        if (atomic_fetch_sub(&pool.pending, 1) == 1) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
        if (b && id == 1) prefetch_after(b, seen, m);
    }
    return NULL;
}

/* The back runs of a twin: its words and the scales and biases of their groups. */
static void prefetch_twin(const Twin *t, unsigned seen) {
    long budget = PrefetchBytes, row = (long)t->n * 4;
    int per = 32 / t->bits;
    for (int c = KChunks - 1; c >= 0 && budget > 0; c--) {
        int k0 = chunk_start(t->k, c), k1 = chunk_start(t->k, c + 1);
        for (int w = (k1 - 1) / per; k1 > k0 && w >= k0 / per && budget > 0; w--) {
            if (atomic_load_explicit(&pool.generation, memory_order_relaxed) != seen) return;
            const char *p[3] = {(const char *)(t->words + (long)w * t->n), NULL, NULL};
            if ((w * per) % t->group == 0) {
                p[1] = (const char *)(t->scales + (long)(w * per / t->group) * t->n);
                p[2] = (const char *)(t->biases + (long)(w * per / t->group) * t->n);
            }
            for (int i = 0; i < 3; i++)
                if (p[i]) {
                    for (long q = 0; q < row; q += 64) __builtin_prefetch(p[i] + q, 0, 2);
                    budget -= row;
                }
        }
    }
}

/* After a product of `m` rows by `b`: the next product of a step has as many rows. */
static void prefetch_after(const float *b, unsigned seen, int m) {
    unsigned s = slot_of(b);
    if (atomic_load_explicit(&next_of[s].from, memory_order_relaxed) != b) return;
    const float *to = atomic_load_explicit(&next_of[s].to, memory_order_relaxed);
    int k = atomic_load_explicit(&next_of[s].k, memory_order_relaxed);
    int n = atomic_load_explicit(&next_of[s].n, memory_order_relaxed);
    int ldb = atomic_load_explicit(&next_of[s].ldb, memory_order_relaxed);
    /* A product that reads a twin gets the twin: the floats would only crowd the cache (and a
     * product of more rows than read twins gets the floats, twin or not). */
    Twin *twin = m <= TwinMaxRows ? twin_acquire(to, k, n, ldb) : NULL;
    if (twin) {
        prefetch_twin(twin, seen);
        twin_release(twin);
        return;
    }
    long budget = PrefetchBytes;
    for (int c = KChunks - 1; c >= 0 && budget > 0; c--) {
        int k0 = chunk_start(k, c), k1 = chunk_start(k, c + 1);
        for (int r = k1 - 1; r >= k0 && budget > 0; r--) {
            if (atomic_load_explicit(&pool.generation, memory_order_relaxed) != seen) return;
            const char *row = (const char *)(to + (long)r * ldb);
            for (long q = 0; q < (long)n * 4; q += 64) __builtin_prefetch(row + q, 0, 2);
            budget -= (long)n * 4;
        }
    }
}

static void start_pool(void) {
    int threads = openblas_get_num_threads();
    pool.owner = getpid();
    for (long id = 1; id < threads; id++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker, (void *)id) == 0) pool.workers++;
        pthread_attr_destroy(&attr);
        if (pool.workers != id) break;
    }
}

/* The output of a K-split job: its partials added in run order (a run too short to hold a
 * block of rows is empty, the same on every machine, and skipped). */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void add_partials(const Job *j) {
    long mn = (long)j->m * j->n;
    int used[KChunks], nused = 0;
    for (int c = 0; c < KChunks; c++)
        if (chunk_start(j->k, c + 1) > chunk_start(j->k, c)) used[nused++] = c;
    for (int i = 0; i < j->m; i++) {
        float *o = j->c + (long)i * j->ldc;
        const float *p = j->partials + (long)i * j->n;
        for (int q = 0; q < j->n; q++) {
            float s = p[used[0] * mn + q];
            for (int u = 1; u < nused; u++) s += p[used[u] * mn + q];
            o[q] = j->beta == 0.0f ? j->alpha * s : j->alpha * s + j->beta * o[q];
        }
    }
}

/* Every part of `job`, the caller's thread taking part 0 and the pool's workers the rest. */
static void run_parts(Job job) {
    pthread_once(&pool_once, start_pool);
    /* Each part 64 columns or more (or a run of K): waking a thread costs more than a few
     * columns' weights. */
    int most = job.partials ? KChunks : job.n / 64 > 1 ? job.n / 64 : 1;
    job.parts = pool.workers + 1 < most ? pool.workers + 1 : most;
    if (job.parts == 1 || getpid() != pool.owner || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int t = 0; t < job.parts; t++) part(&job, t);
        return;
    }
    /* The job is written before the generation is bumped and read after it is seen; the next
     * job waits until every worker has counted itself out of this one. */
    pool.job = job;
    atomic_store(&pool.pending, pool.workers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    part(&job, 0);
    if (!spin_wait(NULL, 0, &pool.pending)) {
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.pending) != 0) pthread_cond_wait(&pool.done, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.busy);
}

static void few_rows(Job job) {
    atomic_int front = 0, back = KChunks - 1;
    atomic_uint claimed = 0;
    if (job.partials) {
        job.front = &front, job.back = &back, job.claimed = &claimed;
        record_next(&job);
    }
    run_parts(job);
    if (job.partials) add_partials(&job);
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
    if (ta_no && m <= TinyRows && (long)n * k < MinForwardElements && alpha == 1.0f && beta == 0.0f &&
        tiny_kernels()) {
        if (tb_no)
            panel_kernel()(m, k, a, lda, b, ldb, c, ldc, 0, n);
        else
            tiny_nt(m, k, a, lda, b, ldb, c, ldc, n);
        return;
    }
    panel_fn panel = tb_no && ta_no && m > MaxFewRows && m <= MaxPanelRows && alpha == 1.0f && beta == 0.0f &&
                         (long)n * k >= MinForwardElements
                         ? panel_kernel()
                         : NULL;
    if (panel) {
        few_rows((Job){.m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc, .alpha = alpha, .beta = beta,
                       .a = a, .b = b, .c = c, .panel = panel});
        return;
    }
    if (big < MinForwardElements || (m != 1 && n != 1 && (m > MaxFewRows || !ta_no))) {
        gemm(RowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (tb_no && ta_no && m <= MaxFewRows && n > 1) {
        float *partials = malloc(sizeof(float) * KChunks * (size_t)m * (size_t)n);
        if (!partials) {
            gemm(RowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
        Twin *twin = m <= TwinMaxRows ? twin_acquire(b, k, n, ldb) : NULL;
        few_rows((Job){.m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc, .alpha = alpha, .beta = beta,
                       .a = a, .b = b, .c = c, .partials = partials, .twin = twin});
        twin_release(twin);
        free(partials);
    } else if (m > 1 && n > 1) {
        /* 2 to 12 rows by weights stored [out, in] (mlx-lm's): each output column is a dot
         * product of two contiguous rows, so splitting the columns streams whole rows. */
        float *scratch = beta != 0.0f ? malloc(sizeof(float) * (size_t)m * (size_t)n) : NULL;
        if (beta != 0.0f && !scratch) {
            gemm(RowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
        few_rows((Job){.m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc,
                       .alpha = alpha, .beta = beta, .a = a, .b = b, .c = c, .scratch = scratch});
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
