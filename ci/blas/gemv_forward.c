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
 * matrix (see record_next). Every other call, and every other BLAS symbol, is OpenBLAS's.
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

/* What a report's environment says of this file (src/environment.rs and ci/bench_mlx_lm.py
 * read it): a baseline measured with other forwarding is refused against this one. */
const char *parity_blas_shim(void) {
    return parity_gemv_forward()
               ? "1-12-row GEMM reading the weights once, split K in 8 runs by [in, out] weights and prefetched, "
                 "other one-row GEMM as GEMV"
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

/* Products of up to MaxFewRows rows by a weight matrix of at least MinForwardElements read the
 * weights once for every row. A row's sums do not depend on how many rows share the call: every
 * output element is summed over K in one order whatever the number of rows, so a sequence
 * decoded next to one other gets the logits it gets next to eleven (and, with the weights
 * stored [in, out], the logits it gets alone). */
enum { MaxFewRows = 12, KRows = 4 };
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* acc (m x n) = A B over a run of B's rows stored [k][n], KRows rows at a time: the thread
 * streams KRows whole rows at once, and each element of acc gets its products in k's order,
 * added one by one, so its sum does not depend on how many rows A has. (Sixteen rows at a
 * time, over a thread's share of the columns, read the o and down matrices at 13-17 GB/s
 * inside a decode step; four whole rows read them at 21-27.) */
static inline __attribute__((always_inline)) void nn_run(int m, int k, const float *a, int lda, const float *b,
                                                          int ldb, float *acc, int n) {
    for (int k0 = 0; k0 < k; k0 += KRows) {
        int kb = k - k0 < KRows ? k - k0 : KRows;
        int j = 0;
        for (; j + 16 <= n; j += 16) {
            v16 bv[KRows] = {{0}};
            for (int r = 0; r < KRows; r++)
                if (r < kb) memcpy(&bv[r], b + (long)(k0 + r) * ldb + j, sizeof(v16));
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

/* Products of 1 to MaxFewRows rows by a matrix stored [k][n] (parity's [in, out] weights) are
 * split along K, not the columns: K is cut into KChunks runs of whole rows (multiples of 16,
 * fixed by k alone), each summed from zero in k's order into a partial output, and the
 * partials are added in run order. Threads take whole runs, so each streams whole rows:
 * splitting the columns left each of two threads a 1152-byte piece of every 2304-byte row of
 * SmolLM2's o and down matrices. The runs depend on neither the thread count nor m, so a row's
 * sums are the same on any number of cores and next to 0 to 11 other rows. */
enum { KChunks = 8 };
static int chunk_start(int k, int c) { return c == KChunks ? k : (int)((long)k * c / KChunks) / 16 * 16; }

/* C (m x n, ldc) = alpha A op(B) + beta C, A's rows contiguous; `scratch` (m x n) holds the
 * sums when beta != 0 (beta == 0 must not read C, see gemv above: then C itself holds them).
 * With `partials` (KChunks x m x n), the job is split K as above: parts fill the partials and
 * the caller adds them. */
typedef struct {
    int m, n, k, lda, ldb, ldc, parts;
    float alpha, beta;
    const float *a, *b;
    float *c, *scratch, *partials;
    /* A K-split job's runs are claimed, not dealt: the caller takes them from the front, the
     * workers from the back, each run once (`claimed`, a bit a run), so a worker that finds
     * its runs already in cache finishes them and takes more. */
    atomic_int *front, *back;
    atomic_uint *claimed;
} Job;

/* Part `t` of `parts` of a job (0 is the caller's): of a K-split job, the runs it claims; of
 * another, a run of the output's columns, a multiple of 16 wide. Compiled for AVX-512, AVX2 +
 * FMA and the baseline, chosen at load by the CPU; a sum is the same whichever part computes
 * it. */
__attribute__((target_clones("avx512f", "arch=haswell", "default"))) static void part(const Job *j, int t) {
    /* A side stops at the first run the other side claimed: past it, all are the other's. */
    while (j->partials) {
        int c = t == 0 ? atomic_fetch_add(j->front, 1) : atomic_fetch_sub(j->back, 1);
        if (c < 0 || c >= KChunks || (atomic_fetch_or(j->claimed, 1u << c) & (1u << c))) return;
        int k0 = chunk_start(j->k, c), k1 = chunk_start(j->k, c + 1);
        if (k1 > k0)
            nn_run(j->m, k1 - k0, j->a + k0, j->lda, j->b + (long)k0 * j->ldb, j->ldb,
                   j->partials + (long)c * j->m * j->n, j->n);
    }
    int per = ((j->n + j->parts - 1) / j->parts + 15) & ~15;
    int j0 = t * per < j->n ? t * per : j->n, j1 = j0 + per < j->n ? j0 + per : j->n;
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

static void prefetch_after(const float *b, unsigned seen);

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
        if (id < pool.job.parts) part(&pool.job, id);
        if (atomic_fetch_sub(&pool.pending, 1) == 1) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
        if (b && id == 1) prefetch_after(b, seen);
    }
    return NULL;
}

static void prefetch_after(const float *b, unsigned seen) {
    unsigned s = slot_of(b);
    if (atomic_load_explicit(&next_of[s].from, memory_order_relaxed) != b) return;
    const float *to = atomic_load_explicit(&next_of[s].to, memory_order_relaxed);
    int k = atomic_load_explicit(&next_of[s].k, memory_order_relaxed);
    int n = atomic_load_explicit(&next_of[s].n, memory_order_relaxed);
    int ldb = atomic_load_explicit(&next_of[s].ldb, memory_order_relaxed);
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
__attribute__((target_clones("avx512f", "arch=haswell", "default"))) static void add_partials(const Job *j) {
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
        few_rows((Job){.m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc, .alpha = alpha, .beta = beta,
                       .a = a, .b = b, .c = c, .partials = partials});
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
