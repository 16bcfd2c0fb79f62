// Two builds of one of MLX's fused CPU kernels (a SiLU-gate's `x * sigmoid(x) * y`, or any kernel
// of two float32 inputs and one output) held to each other bit for bit, and timed.
//
// The old build is loaded after libmlx.so (RTLD_GLOBAL), as in a parity process, so that its
// out-of-line calls bind where they bind there (MLX's `exp` into libmlx's baseline copy). Every
// float32 bit pattern goes through the contiguous kernels as x, with y alternately 1.0 (the
// activation itself) and a value in [-4, 4); then 64 rows of 1536 taken from rows of 3072 (the
// gate and up halves of a stacked output) through the strided kernels.
//
//   g++ -O2 -o /tmp/compare_kernels ci/jit/compare_kernels.cpp -ldl
//   /tmp/compare_kernels LIBMLX OLD_DIR NEW_DIR KERNEL
//
// KERNEL is the name without its `_contiguous` / `_strided_2` suffix; each directory holds
// lib<KERNEL>_contiguous.so and lib<KERNEL>_strided_2.so (MLX's cache holds the sources: build
// them with `g++ -std=c++17 -O3 -shared -fPIC -I<wheel>/mlx/include <flags>`).
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

typedef void (*Kernel)(int *, int64_t **, void **);

static Kernel load(const std::string &dir, const std::string &name) {
    std::string path = dir + "/lib" + name + ".so";
    void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    Kernel k = (Kernel)dlsym(h, name.c_str());
    if (!k) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    return k;
}

static unsigned rng = 12345;
static float next_uniform(float lo, float hi) {
    rng = rng * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(rng >> 8) / (float)(1 << 24);
}

// Nanoseconds an element, best of five runs of 50 calls.
static double time_ns(Kernel k, int *shape, int64_t **strides, void **args, size_t elements) {
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        auto t = std::chrono::steady_clock::now();
        for (int i = 0; i < 50; i++) k(shape, strides, args);
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        best = std::min(best, s / 50 / (double)elements * 1e9);
    }
    return best;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s LIBMLX OLD_DIR NEW_DIR KERNEL\n", argv[0]);
        return 2;
    }
    if (!dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    std::string contiguous = std::string(argv[4]) + "_contiguous", strided = std::string(argv[4]) + "_strided_2";
    Kernel old_c = load(argv[2], contiguous), new_c = load(argv[3], contiguous);
    Kernel old_s = load(argv[2], strided), new_s = load(argv[3], strided);

    const size_t chunk = 1 << 22;
    std::vector<float> x(chunk), y(chunk), a(chunk), b(chunk);
    uint64_t differ = 0;
    for (uint64_t base = 0; base < (1ull << 32); base += chunk) {
        for (size_t i = 0; i < chunk; i++) {
            uint32_t u = (uint32_t)(base + i);
            memcpy(&x[i], &u, 4);
            y[i] = (i & 1) ? 1.0f : next_uniform(-4, 4);
        }
        void *args_a[4] = {x.data(), y.data(), a.data(), (void *)chunk};
        void *args_b[4] = {x.data(), y.data(), b.data(), (void *)chunk};
        old_c(nullptr, nullptr, args_a);
        new_c(nullptr, nullptr, args_b);
        for (size_t i = 0; i < chunk; i++)
            if (memcmp(&a[i], &b[i], 4) != 0 && differ++ < 5)
                fprintf(stderr, "x = %a: %a vs %a\n", (double)x[i], (double)a[i], (double)b[i]);
    }
    printf("contiguous: %llu of 2^32 inputs differ\n", (unsigned long long)differ);

    int rows = 64, cols = 1536;
    std::vector<float> stacked((size_t)rows * 2 * cols), out_a((size_t)rows * cols), out_b((size_t)rows * cols);
    for (float &v : stacked) v = next_uniform(-10, 10);
    int shape[2] = {rows, cols};
    int64_t s_out[2] = {cols, 1}, s_in[2] = {2 * cols, 1};
    int64_t *strides[3] = {s_out, s_in, s_in};
    void *sa[3] = {stacked.data(), stacked.data() + cols, out_a.data()};
    void *sb[3] = {stacked.data(), stacked.data() + cols, out_b.data()};
    old_s(shape, strides, sa);
    new_s(shape, strides, sb);
    bool same = memcmp(out_a.data(), out_b.data(), out_a.size() * 4) == 0;
    printf("strided: %s\n", same ? "identical" : "DIFFER");

    size_t n = (size_t)rows * cols;
    std::vector<float> cx(stacked.begin(), stacked.begin() + (long)n), cy(n, 0.5f), co(n);
    void *cargs[4] = {cx.data(), cy.data(), co.data(), (void *)n};
    printf("ns an element, old / new: contiguous %.2f / %.2f, strided %.2f / %.2f\n",
           time_ns(old_c, nullptr, nullptr, cargs, n), time_ns(new_c, nullptr, nullptr, cargs, n),
           time_ns(old_s, shape, strides, sa, n), time_ns(new_s, shape, strides, sb, n));
    return differ == 0 && same ? 0 : 1;
}
