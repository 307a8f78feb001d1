#include "kernels/cpu/gla_gate.hpp"

#include <cmath>
#include <cstdint>

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

void gla_gate_forward_impl(const float* z, int64_t rows, int64_t width, float normalizer,
                           float clamp_min, float* gk) {
  const int64_t n = rows * width;
  const float inv = 1.0f / normalizer;
  const int64_t blocks = (n + kW - 1) / kW;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const int64_t i = bl * kW;
    if (i + kW <= n) {
      const vf g = logsigmoid(load(z + i)) * inv;
      store(gk + i, g < splat(clamp_min) ? splat(clamp_min) : g);
    } else {
      for (int64_t j = i; j < n; ++j) {
        const float g = logsigmoid(z[j]) * inv;
        gk[j] = g < clamp_min ? clamp_min : g;
      }
    }
  }
}

void gla_gate_backward_impl(const float* dgk, const float* z, int64_t rows, int64_t width,
                            float normalizer, float clamp_min, float* dz) {
  const int64_t n = rows * width;
  const float inv = 1.0f / normalizer;
  const int64_t blocks = (n + kW - 1) / kW;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const int64_t i = bl * kW;
    if (i + kW <= n) {
      const vf zi = load(z + i);
      const vf d = load(dgk + i) * sigmoid_neg(zi) * inv;
      store(dz + i, logsigmoid(zi) * inv < splat(clamp_min) ? splat(0.0f) : d);
    } else {
      for (int64_t j = i; j < n; ++j) {
        const float d = dgk[j] * sigmoid_neg(z[j]) * inv;
        dz[j] = logsigmoid(z[j]) * inv < clamp_min ? 0.0f : d;
      }
    }
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

void gla_gate_forward(const float* z, int64_t rows, int64_t width, float normalizer,
                      float clamp_min, float* gk) {
  check_args("gla_gate_forward", rows, width, normalizer);
  LOOM_DISPATCH(gla_gate_forward_impl)(z, rows, width, normalizer, clamp_min, gk);
}

void gla_gate_backward(const float* dgk, const float* z, int64_t rows, int64_t width,
                       float normalizer, float clamp_min, float* dz) {
  check_args("gla_gate_backward", rows, width, normalizer);
  LOOM_DISPATCH(gla_gate_backward_impl)(dgk, z, rows, width, normalizer, clamp_min, dz);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
