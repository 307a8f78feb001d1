#include "kernels/cpu/swiglu.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/error.hpp"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMin = int64_t{1} << 14;

// exp(x) written so that `omp simd` loops vectorize it: glibc's vector expf is only declared
// under -ffast-math, and a scalar expf call per element would dominate this memory-bound kernel.
// x = k ln2 + r with |r| <= ln2/2 (ln2 split in two so k * ln2_hi is exact), exp(r) by its Taylor
// polynomial to degree 7 (truncation < 1e-8 relative), times 2^k built in the exponent bits.
// Accurate to a few ulp. x is clamped to [-87, 88] so 2^k stays a normal float: exp(-g) for
// sigmoid then never overflows, and the clamp's effect on silu is below 1e-36. NaN propagates.
inline float exp_simd(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Adding 1.5 * 2^23 rounds x / ln2 to the integer k, which lands in the low mantissa bits.
  constexpr float kShift = 12582912.0f;
  const float kf = x * 1.44269504088896341f + kShift;
  const float k = kf - kShift;
  const float r = (x - k * 0.693145751953125f) - k * 1.4286068202862268e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uint32_t kbits;
  std::memcpy(&kbits, &kf, sizeof(kbits));
  const uint32_t bits = (kbits - 0x4b400000u + 127u) << 23;  // 0x4b400000 = bits of kShift
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp_simd(-x));
}

void check_args(const char* what, int64_t rows, int64_t F) {
  LOOM_CHECK(rows >= 0, what, ": rows must be >= 0, got ", rows);
  LOOM_CHECK(F > 0, what, ": F (hidden size of the MLP) must be > 0, got ", F);
}

}  // namespace

void swiglu_forward(const float* gu, int64_t rows, int64_t F, float* h) {
  check_args("swiglu_forward", rows, F);
#pragma omp parallel for schedule(static) if (rows * F >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict g = gu + r * 2 * F;
    const float* __restrict u = g + F;
    float* __restrict hr = h + r * F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) hr[j] = g[j] * sigmoid(g[j]) * u[j];
  }
}

// With s = sigmoid(g): d silu(g)/dg = s + g s (1 - s) = s (1 + g (1 - s)).
void swiglu_backward(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu) {
  check_args("swiglu_backward", rows, F);
#pragma omp parallel for schedule(static) if (rows * F >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    // No __restrict here: dgu may be gu itself (the model overwrites the saved gate/up in place).
    // Each element is read into registers before its gradients are stored.
    const float* g = gu + r * 2 * F;
    const float* u = g + F;
    const float* d = dh + r * F;
    float* dg = dgu + r * 2 * F;
    float* du = dg + F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      const float gj = g[j], uj = u[j], dj = d[j];
      const float s = sigmoid(gj);
      dg[j] = dj * uj * s * (1.0f + gj * (1.0f - s));
      du[j] = dj * gj * s;
    }
  }
}

}  // namespace loom::cpu
