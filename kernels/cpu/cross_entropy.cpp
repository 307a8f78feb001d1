#include "kernels/cpu/cross_entropy.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "kernels/cpu/gemm.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cross_entropy.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// Softmax of one row of logits in place, turned into d(loss)/d(logits) = (softmax - onehot) *
// scale; returns the row's loss lse - logit[t]. `out16` (bf16 mode) receives the gradient
// instead of the row.
inline double softmax_grad_row(float* row, int64_t V, int32_t t, float scale, bool need_grad,
                               bf16* out16, bool native) {
  // The maximum in explicit vectors, four chains: `omp simd reduction(max)` over std::max stayed
  // a scalar vmaxss chain (60% of this function's time at V 4096). Whichever maximum a NaN logit
  // leaves, the exp below carries the NaN into the sum and the loss.
  float m = row[0];
  int64_t j0 = 0;
  if (V >= 4 * kW) {
    vf m4[4] = {load(row), load(row + kW), load(row + 2 * kW), load(row + 3 * kW)};
    for (j0 = 4 * kW; j0 + 4 * kW <= V; j0 += 4 * kW)
      for (int u = 0; u < 4; ++u) {
        const vf x = load(row + j0 + u * kW);
        m4[u] = x > m4[u] ? x : m4[u];
      }
    for (int u = 1; u < 4; ++u) m4[0] = m4[u] > m4[0] ? m4[u] : m4[0];
    for (int l = 0; l < kW; ++l) m = std::max(m, m4[0][l]);
  }
  for (int64_t j = j0; j < V; ++j) m = std::max(m, row[j]);
  const float logit_t = row[t];
  float s = 0;
  // Explicit vectors of kW lanes (see vexp(vf)), the scalar vexp for the tail.
  vf sv{};
  j0 = 0;
  if (!need_grad) {
    for (; j0 + kW <= V; j0 += kW) sv += vexp(load(row + j0) - m);
    s = reduce_add(sv);
    for (int64_t j = j0; j < V; ++j) s += vexp(row[j] - m);
    return static_cast<double>(std::log(s)) + (static_cast<double>(m) - logit_t);
  }
  for (; j0 + kW <= V; j0 += kW) {
    const vf e = vexp(load(row + j0) - m);
    store(row + j0, e);
    sv += e;
  }
  s = reduce_add(sv);
  for (int64_t j = j0; j < V; ++j) {
    const float e = vexp(row[j] - m);
    row[j] = e;
    s += e;
  }
  const float k = scale / s;
  const float g_t = row[t] * k - scale;
  if (out16) {
    int64_t j = 0;
    for (; j + kW <= V; j += kW) store_bf16_operand(out16 + j, load(row + j) * k, native);
    for (; j < V; ++j) out16[j] = to_bf16_operand(row[j] * k, native);
    out16[t] = to_bf16_operand(g_t, native);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) row[j] *= k;
    row[t] = g_t;
  }
  return static_cast<double>(std::log(s)) + (static_cast<double>(m) - logit_t);
}

}  // namespace

// The loss of rows [0, c) of a chunk of logits L (V per row), turned into their gradients.
double softmax_rows_impl(float* L, bf16* G16, int64_t c, int64_t V, const int32_t* tg, float scale,
                         bool need_grad, bool native) {
  double loss = 0;
#pragma omp parallel for schedule(static) reduction(+ : loss)
  for (int64_t i = 0; i < c; ++i) {
    float* row = L + i * V;
    bf16* row16 = G16 ? G16 + i * V : nullptr;
    if (tg[i] < 0) {  // ignored: no loss, zero gradient
      if (row16)
        std::fill_n(row16, V, bf16{});
      else if (need_grad)
        std::fill_n(row, V, 0.0f);
      continue;
    }
    loss += softmax_grad_row(row, V, tg[i], scale, need_grad, row16, native);
  }
  return loss;
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

// The default chunk is the number of rows whose f32 logits take this much memory. The dW update
// reads and writes all of dW once per chunk, so its cost relative to the GEMM work falls with the
// rows of a chunk: at N=2048, D=512, V=8192 (one core, CPU time), 128 rows (4 MiB) took 189 ms in
// bf16 and 312 ms in f32, 512 rows (16 MiB) 147 and 265 ms, and 2048 rows 138 and 272 ms. 16 MiB
// is past the knee (with two threads too: 512 rows within 5% of 2048, 128 rows 30% slower) while
// keeping the scratch bounded for large vocabularies.
constexpr int64_t kChunkBytes = int64_t{16} << 20;

}  // namespace

HWY_EXPORT(softmax_rows_impl);

LinearCrossEntropyChunks linear_cross_entropy_chunks(int64_t N, int64_t V, int64_t chunk_rows,
                                                     int64_t grad_rows) {
  const int64_t rows =
      std::min(N, chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, kChunkBytes / (V * 4)));
  if (rows == 0) return {};
  return {rows, std::min(N, std::max(rows, grad_rows / rows * rows))};
}

size_t linear_cross_entropy_packed_bytes(int64_t N, int64_t D, int64_t V, DType ab,
                                         const LinearCrossEntropyChunks& ch, bool grad16) {
  if (ch.rows <= 0 || ch.rows >= N) return 0;
  const size_t packed = packed_linear_forward_bytes(ch.rows, V, D, ab);
  const size_t scratch =
      size_t(ch.rows) * size_t(V) * 4 + (grad16 ? size_t(ch.grad_rows) * size_t(V) * 2 : 0);
  return packed <= scratch ? packed : 0;
}

double linear_cross_entropy(const LinearCrossEntropyArgs& a) {
  LOOM_CHECK(a.ab == DType::f32 || a.ab == DType::bf16,
             "linear_cross_entropy: x and w must be float32 or bfloat16, got ", dtype_name(a.ab));
  LOOM_CHECK(a.N >= 0 && a.D > 0 && a.V > 0, "linear_cross_entropy: expected N >= 0, D > 0, ",
             "V > 0, got N=", a.N, " D=", a.D, " V=", a.V);
  LOOM_CHECK(a.chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0 (0: automatic), ",
             "got ", a.chunk_rows);
  if (a.N == 0) {
    if (a.dw && a.dw_overwrite) std::fill_n(a.dw, a.V * a.D, 0.0f);
    return 0.0;
  }
  LOOM_CHECK(a.x && a.w && a.targets, "linear_cross_entropy: x, w and targets must be non-null");
  // Validate every target before any output is touched, so an error leaves dw as it was.
  for (int64_t i = 0; i < a.N; ++i)
    LOOM_CHECK(a.targets[i] < a.V, "linear_cross_entropy: target ", a.targets[i], " of row ", i,
               " is out of range for a vocabulary of ", a.V, " (expected < ", a.V,
               ", or < 0 to ignore the row)");

  const bool need_grad = a.dx || a.dw;
  const bool bf16_mode = a.ab == DType::bf16;
  const bool grad16 = bf16_mode && need_grad;
  const bool native = avx512_bf16_native();  // the bf16 gradients' rounding (vec_math-inl.hpp)
  const LinearCrossEntropyChunks ch =
      linear_cross_entropy_chunks(a.N, a.V, a.chunk_rows, grad16 ? a.grad_rows : 0);
  const size_t esz = dtype_size(a.ab);
  // Allocated once per call from the caching allocator, so the scratch is counted in its stats.
  const MemoryUseScope use(Device::cpu, MemoryUse::loss);
  Tensor logits = Tensor::empty({ch.rows, a.V}, DType::f32);
  Tensor g16 = grad16 ? Tensor::empty({ch.grad_rows, a.V}, DType::bf16) : Tensor();
  float* L = logits.data<float>();
  bf16* G16 = grad16 ? g16.data<bf16>() : nullptr;
  const void* dlogits = G16 ? static_cast<const void*>(G16) : static_cast<const void*>(L);

  // Every chunk's logits GEMM reads all of w: reordered once for all of them where that pays.
  const PackedB w_fwd = linear_cross_entropy_packed_bytes(a.N, a.D, a.V, a.ab, ch, grad16) > 0
                            ? pack_linear_forward(a.w, ch.rows, a.V, a.D, a.ab)
                            : PackedB();
  // Groups of grad_rows rows (one chunk's unless bf16 gathers several): the logits and softmax
  // chunk by chunk into the group's gradients, then the two backward GEMMs over the group.
  double loss = 0;
  for (int64_t g0 = 0; g0 < a.N; g0 += ch.grad_rows) {
    const int64_t gn = std::min(ch.grad_rows, a.N - g0);
    for (int64_t r0 = g0; r0 < g0 + gn; r0 += ch.rows) {
      const int64_t c = std::min(ch.rows, g0 + gn - r0);
      const void* xc = static_cast<const char*>(a.x) + r0 * a.D * esz;
      linear_forward(xc, a.w, w_fwd, L, c, a.V, a.D, a.ab);
      bf16* g = G16 ? G16 + (r0 - g0) * a.V : nullptr;
      loss += LOOM_DISPATCH(softmax_rows_impl)(L, g, c, a.V, a.targets + r0, a.grad_scale,
                                               need_grad, native);
    }
    const void* xg = static_cast<const char*>(a.x) + g0 * a.D * esz;
    if (a.dx) linear_backward_input(dlogits, a.w, a.dx + g0 * a.D, gn, a.V, a.D, a.ab, false);
    if (a.dw)
      linear_backward_weight(dlogits, xg, a.dw, gn, a.V, a.D, a.ab, !(a.dw_overwrite && g0 == 0));
  }
  return loss;
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
