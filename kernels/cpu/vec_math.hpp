#pragma once
// Vector helpers shared by the CPU kernels: a 16-float GCC vector type (one zmm register with
// AVX-512, split by the compiler into narrower registers elsewhere, so every target builds), and
// exp written out in plain arithmetic so that the loops calling it vectorize. glibc's vector expf
// is only declared under -ffast-math, which the project does not use, and a scalar expf call per
// element would dominate the kernels that need exp (SwiGLU, the softmax of cross-entropy, the
// online softmax of attention).
//
// Both exps use one scheme: the result is 2^n e^r with n an integer and |r| <= ln2/2, e^r by its
// degree-7 Taylor polynomial (truncation below 1e-8 relative, under f32 rounding), times 2^n
// built directly in the exponent bits. Measured against a long double exp on every 7th float
// bit pattern in the unclamped range: both below 0.93 ulp.
#include <cstdint>
#include <cstring>

// Functions that pass the 64-byte vector by value get a different ABI when AVX-512 is off
// (LOOM_NATIVE=OFF), and GCC warns about it; they are all inline and never cross a library
// boundary, so the warning does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loom::cpu {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned access
// Floats per v16.
constexpr int64_t kW = 16;

inline v16 load(const float* p) {
  return *reinterpret_cast<const v16u*>(p);
}
inline void store(float* p, v16 x) {
  *reinterpret_cast<v16u*>(p) = x;
}
inline v16 splat(float x) {
  return v16{} + x;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

namespace vec_math_detail {

// 1.5 * 2^23. For |y| < 2^22, y + kRound rounds y to the nearest integer n (in the default
// rounding mode, with no -ffast-math to reassociate it away), and the low mantissa bits of the sum
// hold n, so bits(y + kRound) - bits(kRound) = n.
constexpr float kRound = 12582912.0f;
constexpr int32_t kRoundBits = 0x4b400000;

// e^r for |r| <= ln2/2 (works on float and on v16): Taylor polynomial of degree 7 by Horner.
template <class V>
inline V exp_taylor7(V r) {
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p;
}

}  // namespace vec_math_detail

// e^x, for scalar code inside `#pragma omp simd` loops (the compiler vectorizes all of it).
// The reduction x - n ln2 uses ln2 split in two (Cody-Waite: n * ln2_hi is exact), so the result
// stays within 1 ulp for any |x| up to the clamp.
// Clamping: x is clamped to [-87, 88] so that 2^n stays a normal float. Below -87 the result is
// exp(-87) ~ 1.6e-38 instead of smaller or 0: a softmax (x = logit - max <= 0) sums it next to
// the maximum's exp(0) = 1, where it vanishes. Above 88 the result is exp(88) ~ 1.7e38 instead of
// inf, so 1 + exp(-g) in a sigmoid never overflows; silu(g) = g * sigmoid(g) for g < -88 is then
// off by less than 1e-36 absolute. NaN propagates (the clamp's comparisons are false for NaN).
inline float vexp(float x) {
  using namespace vec_math_detail;
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = x * kLog2e + kRound;
  const float n = t - kRound;
  const float r = (x - n * 0.693145751953125f) - n * 1.4286068202862268e-6f;  // ln2 hi + lo
  int32_t tbits;
  std::memcpy(&tbits, &t, sizeof(tbits));
  const int32_t bits = (tbits - kRoundBits + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_taylor7(r) * scale;
}

// 2^x on 16 lanes, for the attention kernels. They keep scores in base-2 units (log2(e) is folded
// into the query scale once), so x splits exactly into n + f, |f| <= 1/2, with no Cody-Waite
// step; e^(f ln2) then comes from the same polynomial as vexp. Clamping is chosen for masked
// scores: x is clamped to [-127, 127], and x < -126.5 (in particular -inf) gives exactly 0, so a
// masked score drops out of the softmax sum without a separate select. NaN propagates.
inline v16 vexp2(v16 x) {
  using namespace vec_math_detail;
  const v16 lo = splat(-127.0f), hi = splat(127.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16 t = x + kRound;
  const v16 f = x - (t - kRound);
  const v16i n = __builtin_bit_cast(v16i, t) - kRoundBits;
  const v16i bits = (n + 127) << 23;  // 2^n; n = -127 gives the bit pattern of 0.0f
  return exp_taylor7(f * kLn2) * __builtin_bit_cast(v16, bits);
}

}  // namespace loom::cpu

#pragma GCC diagnostic pop
