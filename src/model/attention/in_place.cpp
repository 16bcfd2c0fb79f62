// Attention's two products over a paged cache's rows where they lie, as an MLX primitive: an
// operation of the step's graph that MLX runs on its CPU stream in order, as it runs its own.
//
// The products themselves are ci/blas/gemv_forward.c's (parity_rows_scores, parity_rows_values:
// the chains its products over a gathered copy run). Computed on the host between two waits,
// they cost a decode step its pipelining: the host waited for the queries and for the softmax in
// every layer, so it could not build step n + 1 while step n ran. As a primitive they are queued
// like any other operation and nothing waits. MLX's C API has no custom CPU operation; this is
// MLX's C++ extension interface (a `Primitive` whose `eval_cpu` dispatches to the stream, as the
// `axpby` example of MLX's documentation does), built against the headers of the MLX the
// process links (build.rs, Linux only).

#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;

extern "C" {
// The shim's parity_rows_scores and parity_rows_values: C (m x n) from A (m x k) and the store
// rows `rows` of `base` (`ldb` floats apart).
typedef void (*parity_rows_fn)(int m, int k, const float* a, int lda, const float* base, int ldb, const int32_t* rows,
                               int n, float* c, int ldc);
// mlx-c's handle: `ctx` owns a heap `mlx::core::array` (mlx-c's private/array.h), which is what
// mlx-rs's Array::from_ptr takes ownership of and frees.
typedef struct {
    void* ctx;
} parity_mlx_array;
}

namespace {

// One product for every (batch row, kv head) pair: that pair's `rows_per` consecutive rows of
// A, `k` wide, by the `l` store rows its batch row reads from that head's store (`d` floats a
// row), into as many rows of C, `n` wide.
struct Geometry {
    int pairs, kv_heads, rows_per, k, n, d, l;
};

// `a`'s elements in row-major order. A decode step's scaled queries and its weights are laid out
// so already; a few-token step's queries are a transposed view. The copy here costs less than a
// `contiguous` operation in the graph would cost every step that needs none.
std::vector<float> row_major(const float* data, const mx::Shape& shape, const mx::Strides& strides) {
    size_t size = 1;
    for (int s : shape) size *= static_cast<size_t>(s);
    std::vector<float> out(size);
    std::vector<int> at(shape.size(), 0);
    for (size_t i = 0; i < size; i++) {
        int64_t offset = 0;
        for (size_t d = 0; d < shape.size(); d++) offset += static_cast<int64_t>(at[d]) * strides[d];
        out[i] = data[offset];
        for (size_t d = shape.size(); d-- > 0;) {
            if (++at[d] < shape[d]) break;
            at[d] = 0;
        }
    }
    return out;
}

class RowsProduct : public mx::UnaryPrimitive {
  public:
    RowsProduct(mx::Stream s, parity_rows_fn product, Geometry g) : mx::UnaryPrimitive(s), product_(product), g_(g) {}

    void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
        const mx::array &a = inputs[0], &store = inputs[1], &rows = inputs[2];
        // The stores are scatters' outputs and the rows an array made from the host's: both
        // row-major by construction. Read at wrong places otherwise, so checked.
        if (!store.flags().row_contiguous || !rows.flags().row_contiguous)
            throw std::invalid_argument("[parity rows] the store or its row index is not row-major");
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto& encoder = mx::cpu::get_command_encoder(stream());
        encoder.set_input_array(a);
        encoder.set_input_array(store);
        encoder.set_input_array(rows);
        encoder.set_output_array(out);
        size_t per_head = static_cast<size_t>(store.shape(1)) * g_.d;
        bool strided = !a.flags().row_contiguous;
        encoder.dispatch([product = product_, g = g_, a = a.data<float>(), shape = a.shape(), strides = a.strides(),
                          strided, store = store.data<float>(), rows = rows.data<int32_t>(), c = out.data<float>(),
                          per_head]() {
            std::vector<float> copy;
            const float* rows_of_a = a;
            if (strided) {
                copy = row_major(a, shape, strides);
                rows_of_a = copy.data();
            }
            for (int pair = 0; pair < g.pairs; pair++) {
                int bi = pair / g.kv_heads, hk = pair % g.kv_heads;
                size_t first = static_cast<size_t>(pair) * g.rows_per;
                product(g.rows_per, g.k, rows_of_a + first * g.k, g.k, store + hk * per_head, g.d,
                        rows + static_cast<size_t>(bi) * g.l, g.n, c + first * g.n, g.n);
            }
        });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("[parity rows] attention in place runs on the CPU only");
    }

    const char* name() const override { return "ParityRowsProduct"; }

  private:
    parity_rows_fn product_;
    Geometry g_;
};

}  // namespace

// `*res` = the lazy product of `a` (`batch * kv_heads * rows_per` rows) by the rows `rows` (int32,
// `l` for each batch row) of `store` (float32 `[kv_heads, rows, d]`), shaped `shape`. Scores
// (`values` 0) take `a` d wide and give l columns; values (`values` 1) take `a` l wide and give d
// columns: the widths follow from the kind, so a product can never read a store row past its d
// floats or a batch row's index past its l. The caller has checked that every index in `rows` is
// under the store's rows (the primitive reads them unchecked). 0 on success; else 1 and a
// message in `err`.
extern "C" int parity_rows_product(parity_mlx_array* res, parity_mlx_array a, parity_mlx_array store,
                                   parity_mlx_array rows, parity_rows_fn product, int values, int batch,
                                   int kv_heads, int rows_per, int l, const int* shape, int ndim, char* err,
                                   size_t err_len) {
    try {
        const mx::array &av = *static_cast<mx::array*>(a.ctx), &sv = *static_cast<mx::array*>(store.ctx),
                        &rv = *static_cast<mx::array*>(rows.ctx);
        if (batch <= 0 || kv_heads <= 0 || rows_per <= 0 || l <= 0 || ndim < 1)
            throw std::invalid_argument("[parity rows] empty geometry");
        if (av.dtype() != mx::float32 || sv.dtype() != mx::float32 || rv.dtype() != mx::int32 || sv.ndim() != 3 ||
            sv.shape(0) != kv_heads || sv.shape(2) <= 0)
            throw std::invalid_argument("[parity rows] operands of another type or store shape");
        int d = sv.shape(2), k = values ? l : d, n = values ? d : l;
        Geometry g{batch * kv_heads, kv_heads, rows_per, k, n, d, l};
        mx::Shape out_shape(shape, shape + ndim);
        size_t rows_a = static_cast<size_t>(g.pairs) * rows_per;
        size_t out_size = 1;
        for (int s : out_shape) out_size *= static_cast<size_t>(s);
        if (av.size() != rows_a * k || out_size != rows_a * n || rv.size() != static_cast<size_t>(batch) * l)
            throw std::invalid_argument("[parity rows] operand sizes do not match the geometry");
        mx::Stream s = mx::default_stream(mx::Device(mx::Device::cpu));
        auto primitive = std::make_shared<RowsProduct>(s, product, g);
        mx::array out(std::move(out_shape), mx::float32, std::move(primitive), {av, sv, rv});
        res->ctx = new mx::array(std::move(out));
        return 0;
    } catch (const std::exception& e) {
        std::snprintf(err, err_len, "%s", e.what());
        return 1;
    }
}
