#include "kernels/cpu/cast.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cast.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// Below this many elements, waking the thread team costs more than the memory traffic saved.
constexpr int64_t kParallelMin = int64_t{1} << 15;

// sum_squares adds fixed-size blocks in a fixed order, so the global gradient norm is the same
// bits whatever the thread count.
constexpr int64_t kSumBlock = int64_t{1} << 16;

double sum_squares_block(const float* __restrict x, int64_t n) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

}  // namespace

void cast_f32_to_bf16_impl(const float* in, bf16* out, int64_t n) {
  const float* __restrict src = in;
  bf16* __restrict dst = out;
  // float_to_bf16 is branch-free enough for the vectorizer (checked with -fopt-info-vec).
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

void cast_bf16_to_f32_impl(const bf16* in, float* out, int64_t n) {
  const bf16* __restrict src = in;
  float* __restrict dst = out;
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

double sum_squares_impl(const float* x, int64_t n) {
  const int64_t nblocks = (n + kSumBlock - 1) / kSumBlock;
  if (nblocks <= 1) return sum_squares_block(x, n);
  std::vector<double> partial(nblocks);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kSumBlock;
    partial[b] = sum_squares_block(x + lo, std::min(kSumBlock, n - lo));
  }
  double s = 0;
  for (double p : partial) s += p;
  return s;
}

void scale_inplace_impl(float* x, int64_t n, float s) {
  float* __restrict p = x;
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

void add_inplace_impl(float* y, const float* x, int64_t n) {
  float* __restrict dst = y;
  const float* __restrict src = x;
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_n(const char* what, int64_t n) {
  LOOM_CHECK(n >= 0, what, ": element count must be >= 0, got ", n);
}

}  // namespace

HWY_EXPORT(cast_f32_to_bf16_impl);
HWY_EXPORT(cast_bf16_to_f32_impl);
HWY_EXPORT(sum_squares_impl);
HWY_EXPORT(scale_inplace_impl);
HWY_EXPORT(add_inplace_impl);

void cast_f32_to_bf16(const float* in, bf16* out, int64_t n) {
  check_n("cast_f32_to_bf16", n);
  LOOM_DISPATCH(cast_f32_to_bf16_impl)(in, out, n);
}

void cast_bf16_to_f32(const bf16* in, float* out, int64_t n) {
  check_n("cast_bf16_to_f32", n);
  LOOM_DISPATCH(cast_bf16_to_f32_impl)(in, out, n);
}

double sum_squares(const float* x, int64_t n) {
  check_n("sum_squares", n);
  return LOOM_DISPATCH(sum_squares_impl)(x, n);
}

void scale_inplace(float* x, int64_t n, float s) {
  check_n("scale_inplace", n);
  LOOM_DISPATCH(scale_inplace_impl)(x, n, s);
}

void add_inplace(float* y, const float* x, int64_t n) {
  check_n("add_inplace", n);
  LOOM_DISPATCH(add_inplace_impl)(y, x, n);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
