#include "kernels/cpu/gla_gate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gla_gate.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

constexpr int64_t kParallelMin = int64_t{1} << 14;

// Written once for float (the tails) and vf (kW lanes): the same operations either way.
template <class V>
inline V vmin0(V z) {
  return z < V{} + 0.0f ? z : V{} + 0.0f;
}
template <class V>
inline V vabs(V z) {
  return z < V{} + 0.0f ? -z : z;
}

// log(1 + y) for y in (0, 1] as 2 atanh(s), s = y / (2 + y) <= 1/3: the odd series to s^15
// (truncation (1/9)^8 / 17 < 3e-9), accurate for tiny y too, where 1 + y would round.
template <class V>
inline V log1p_unit(V y) {
  const V s = y / (2.0f + y);
  const V s2 = s * s;
  V p = V{} + 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return 2.0f * s * p;
}

// logsigmoid(z) = min(z, 0) - log(1 + e^-|z|), never exp of a large positive number.
template <class V>
inline V logsigmoid(V z) {
  return vmin0(z) - log1p_unit(vexp(-vabs(z)));
}
// sigmoid(-z) from y = e^-|z|: y / (1 + y) for z >= 0, 1 / (1 + y) otherwise.
template <class V>
inline V sigmoid_neg(V z) {
  const V y = vexp(-vabs(z));
  return (z < V{} + 0.0f ? V{} + 1.0f : y) / (1.0f + y);
}

}  // namespace

// Row by row, so that the bias lines up with the columns; the rows are the parallel work.
void gla_gate_forward_impl(const float* z, const float* bias, int64_t rows, int64_t width,
                           float normalizer, float clamp_min, float* gk) {
  const float inv = 1.0f / normalizer;
#pragma omp parallel for schedule(static) if (rows * width >= kParallelMin)
  for (int64_t m = 0; m < rows; ++m) {
    const float* zr = z + m * width;
    float* gr = gk + m * width;
    int64_t i = 0;
    for (; i + kW <= width; i += kW) {
      const vf zi = load(zr + i) + (bias ? load(bias + i) : splat(0.0f));
      const vf g = logsigmoid(zi) * inv;
      store(gr + i, g < splat(clamp_min) ? splat(clamp_min) : g);
    }
    for (; i < width; ++i) {
      const float g = logsigmoid(zr[i] + (bias ? bias[i] : 0.0f)) * inv;
      gr[i] = g < clamp_min ? clamp_min : g;
    }
  }
}

// dbias: rows are summed per chunk of rows and the partials added in chunk order; the chunking
// depends only on `rows` (as rmsnorm's dw).
void gla_gate_backward_impl(const float* dgk, const float* z, const float* bias, int64_t rows,
                            int64_t width, float normalizer, float clamp_min, float* dz,
                            float* dbias) {
  constexpr int64_t kMaxChunks = 64;
  const float inv = 1.0f / normalizer;
  const int64_t chunk_rows = std::max<int64_t>(1, (rows + kMaxChunks - 1) / kMaxChunks);
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  std::vector<float> partial(bias && dbias ? size_t(chunks * width) : 0, 0.0f);
#pragma omp parallel for schedule(static) if (rows * width >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t m = c * chunk_rows; m < std::min(rows, (c + 1) * chunk_rows); ++m) {
      const float* zr = z + m * width;
      const float* dr = dgk + m * width;
      float* out = dz + m * width;
      int64_t i = 0;
      for (; i + kW <= width; i += kW) {
        const vf zi = load(zr + i) + (bias ? load(bias + i) : splat(0.0f));
        const vf d = load(dr + i) * sigmoid_neg(zi) * inv;
        store(out + i, logsigmoid(zi) * inv < splat(clamp_min) ? splat(0.0f) : d);
      }
      for (; i < width; ++i) {
        const float zi = zr[i] + (bias ? bias[i] : 0.0f);
        const float d = dr[i] * sigmoid_neg(zi) * inv;
        out[i] = logsigmoid(zi) * inv < clamp_min ? 0.0f : d;
      }
      if (partial.empty()) continue;
      float* __restrict p = partial.data() + c * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) p[j] += out[j];
    }
  }
  for (int64_t c = 0; c < int64_t(partial.size()) / width; ++c) {
    const float* __restrict p = partial.data() + c * width;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) dbias[j] += p[j];
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_args(const char* what, int64_t rows, int64_t width, float normalizer) {
  LOOM_CHECK(rows >= 0 && width > 0, what, ": need rows >= 0 and width > 0, got ", rows, " and ",
             width);
  LOOM_CHECK(normalizer > 0, what, ": gate normalizer must be > 0, got ", normalizer);
}

}  // namespace

HWY_EXPORT(gla_gate_forward_impl);
HWY_EXPORT(gla_gate_backward_impl);

void gla_gate_forward(const float* z, const float* bias, int64_t rows, int64_t width,
                      float normalizer, float clamp_min, float* gk) {
  check_args("gla_gate_forward", rows, width, normalizer);
  LOOM_DISPATCH(gla_gate_forward_impl)(z, bias, rows, width, normalizer, clamp_min, gk);
}

void gla_gate_backward(const float* dgk, const float* z, const float* bias, int64_t rows,
                       int64_t width, float normalizer, float clamp_min, float* dz, float* dbias) {
  check_args("gla_gate_backward", rows, width, normalizer);
  LOOM_DISPATCH(gla_gate_backward_impl)
  (dgk, z, bias, rows, width, normalizer, clamp_min, dz, dbias);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
