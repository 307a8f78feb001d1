// Per-target vector helpers of the CPU kernels (included once per Highway target by each kernel
// file, after hwy/highway.h, inside its foreach_target pass): a float vector type `vf` of kW lanes
// (16 with AVX-512, 8 with AVX2, 4 on the SSE2 baseline), written with GCC vector extensions so
// the same source compiles to each target's registers, and exp written out in plain arithmetic so
// that the loops calling it vectorize. glibc's vector expf is only declared under -ffast-math,
// which the project does not use, and a scalar expf call per element would dominate the kernels
// that need exp (SwiGLU, the softmax of cross-entropy, the online softmax of attention).
//
// Both exps use one scheme: the result is 2^n e^r with n an integer and |r| <= ln2/2, e^r by its
// degree-7 Taylor polynomial (truncation below 1e-8 relative, under f32 rounding), times 2^n
// built directly in the exponent bits. Measured against a long double exp on every 7th float
// bit pattern in the unclamped range: both below 0.93 ulp.

// Highway's per-target include guard: the body is compiled once for every target.
#if defined(LOOM_KERNELS_CPU_VEC_MATH_INL_) == defined(HWY_TARGET_TOGGLE)
#ifdef LOOM_KERNELS_CPU_VEC_MATH_INL_
#undef LOOM_KERNELS_CPU_VEC_MATH_INL_
#else
#define LOOM_KERNELS_CPU_VEC_MATH_INL_
#endif

#include <hwy/highway.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.hpp"

// Functions passing vectors by value get another ABI on narrower targets, and GCC warns; they are
// all inline, per target, and never cross a library boundary.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {

// Floats per vector: one register of the target.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int64_t kW = 16;
#elif HWY_TARGET == HWY_AVX2
constexpr int64_t kW = 8;
#else
constexpr int64_t kW = 4;
#endif
typedef float vf __attribute__((vector_size(kW * 4)));
typedef int32_t vi __attribute__((vector_size(kW * 4)));
typedef float vfu __attribute__((vector_size(kW * 4), aligned(4), may_alias));  // unaligned

inline vf load(const float* p) {
  return *reinterpret_cast<const vfu*>(p);
}
inline void store(float* p, vf x) {
  *reinterpret_cast<vfu*>(p) = x;
}
inline vf splat(float x) {
  return vf{} + x;
}

// bf16 as 16-bit words: kW of them, and the 32-bit lanes they widen into.
typedef uint32_t vu __attribute__((vector_size(kW * 4)));
typedef uint16_t vh __attribute__((vector_size(kW * 2)));
typedef uint16_t vhu __attribute__((vector_size(kW * 2), aligned(2), may_alias));  // unaligned

// float_to_bf16 on every lane of f32 bits b (any width): to nearest even, NaNs kept quiet.
template <class U>
inline U bf16_bits(U b) {
  const U rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return (b & 0x7fffffffu) > 0x7f800000u ? (b >> 16) | 0x40u : rounded;
}
// x rounded to bf16 at p: the bits float_to_bf16 gives each lane, the f32 values never stored.
// With AVX-512 the narrowing and widening are spelled as the one instruction each is
// (vpmovdw, vpmovzxwd): GCC made a two-source word permute and 128-bit pieces of them, and the
// bf16 SwiGLU forward ran 10% slower for it.
inline void store_bf16(bf16* p, vf x) {
  const vu bits = bf16_bits(__builtin_bit_cast(vu, x));
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(__builtin_bit_cast(__m512i, bits)));
#else
  *reinterpret_cast<vhu*>(p) = __builtin_convertvector(bits, vh);
#endif
}
// x rounded to bf16 at p where only a bf16 GEMM or the bf16 attention reads it. With
// `native` (avx512_bf16_native(), asked by the kernel per call) one vcvtneps2bf16, as oneDNN
// rounds its own bf16 outputs: to nearest even, NaNs kept quiet, as store_bf16, except that the
// instruction flushes f32 denormals (below 2^-126) to zero. The software rounding costs about a
// third of the bf16 SwiGLU's time. Inline asm: it runs only where `native` holds, and the code
// around it needs no other target.
inline void store_bf16_operand(bf16* p, vf x, bool native) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if (native) {
    __m256i r;
    asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
    return;
  }
#endif
  (void)native;
  store_bf16(p, x);
}
// One element as store_bf16_operand rounds a lane (the scalar tails of rows), so that a tensor
// never mixes the two roundings of a denormal.
inline bf16 to_bf16_operand(float v, bool native) {
  return float_to_bf16(native && std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v);
}
// kW bf16 at p, widened (exactly: their bits are the high half of the f32's).
inline vf load_bf16(const bf16* p) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return __builtin_bit_cast(vf, _mm512_slli_epi32(w, 16));
#else
  const vh h = *reinterpret_cast<const vhu*>(p);
  return __builtin_bit_cast(vf, __builtin_convertvector(h, vu) << 16);
#endif
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

namespace vec_math_detail {

// 1.5 * 2^23. For |y| < 2^22, y + kRound rounds y to the nearest integer n (in the default
// rounding mode, with no -ffast-math to reassociate it away), and the low mantissa bits of the sum
// hold n, so bits(y + kRound) - bits(kRound) = n.
constexpr float kRound = 12582912.0f;
constexpr int32_t kRoundBits = 0x4b400000;

// e^r for |r| <= ln2/2 (works on float and on vf): Taylor polynomial of degree 7 by Horner.
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

// vexp on kW lanes, the same operations lane by lane. Loops over arrays call this one: GCC
// vectorizes the scalar vexp under `omp simd` only with AVX-512 (masked instructions); on the
// AVX2 and SSE2 targets the clamp's selects stay branches around statements that may trap
// (-ftrapping-math), the loop is not if-converted, and it ran scalar there (SwiGLU 6x slower).
inline vf vexp(vf x) {
  using namespace vec_math_detail;
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf t = x * kLog2e + kRound;
  const vf n = t - kRound;
  const vf r = (x - n * 0.693145751953125f) - n * 1.4286068202862268e-6f;  // ln2 hi + lo
  const vi bits = (__builtin_bit_cast(vi, t) - kRoundBits + 127) << 23;    // 2^n
  return exp_taylor7(r) * __builtin_bit_cast(vf, bits);
}

// Sum of the lanes of x.
inline float reduce_add(vf x) {
  float s = 0;
  for (int l = 0; l < kW; ++l) s += x[l];
  return s;
}

// 2^x on kW lanes, for the attention kernels. They keep scores in base-2 units (log2(e) is folded
// into the query scale once), so x splits exactly into n + f, |f| <= 1/2, with no Cody-Waite
// step; e^(f ln2) then comes from the same polynomial as vexp. Clamping is chosen for masked
// scores: x is clamped to [-127, 127], and x < -126.5 (in particular -inf) gives exactly 0, so a
// masked score drops out of the softmax sum without a separate select. NaN propagates.
// The split behind it (and the bf16 attention's own 2^x): x clamped, then n + f; returns f and
// puts 2^n in `scale` (n = -127 gives the bit pattern of 0.0f).
inline vf exp2_split(vf x, vf& scale) {
  using namespace vec_math_detail;
  const vf lo = splat(-127.0f), hi = splat(127.0f);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // The selects below as one instruction each (GCC emits a compare and a masked move): maxps(a,
  // b) is a > b ? a : b, minps(a, b) a < b ? a : b, so NaN in x still propagates.
  x = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
#elif HWY_TARGET == HWY_AVX2
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
#else
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
#endif
  const vf t = x + kRound;
  const vi n = __builtin_bit_cast(vi, t) - kRoundBits;
  scale = __builtin_bit_cast(vf, (n + 127) << 23);
  return x - (t - kRound);
}
inline vf vexp2(vf x) {
  vf scale;
  const vf f = exp2_split(x, scale);
  return vec_math_detail::exp_taylor7(f * kLn2) * scale;
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#pragma GCC diagnostic pop

#endif  // per-target include guard
