#include "kernels/cpu/adamw.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/adamw.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;

constexpr int64_t kParallelMin = int64_t{1} << 15;

// Elements per block: the block's second moments wait in a stack buffer (in L1) for their square
// roots.
constexpr int64_t kBlock = 512;

// GCC will not vectorize std::sqrt in a loop unless math-errno is off for the whole function, so
// the one step that needs it uses Highway's vector sqrt. IEEE sqrt is correctly rounded on every
// target, so results are identical across tiers.
void sqrt_inplace(float* x, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = int64_t(hn::Lanes(d));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(hn::Sqrt(hn::LoadU(d, x + i)), d, x + i);
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

// One pass through memory over the five (six with bf16) streams: a block's two loops meet in L1
// around the square roots. The scalars are formed in double and rounded once, and the
// per-element steps follow torch.optim.AdamW's single-tensor path op by op (param.mul_,
// exp_avg.lerp_, exp_avg_sq.mul_.addcmul_, denom = sqrt(v) / sqrt(bc2) + eps, param.addcdiv_)
// so that results agree with PyTorch to rounding.
template <bool kBf16>
void adamw_block(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, bf16* __restrict pb, int64_t n, float gscale, float decay,
                 float w1, bool lerp_from_end, float b2, float one_minus_b2, float step_size,
                 float bc2_sqrt, float eps) {
  // The scaled gradients go through memory: a product that stays in a register may be contracted
  // into the FMA of the moments' update (GCC's default -ffp-contract=fast), where clipping in
  // place rounds it first.
  float gs[kBlock], sq[kBlock];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) gs[i] = g[i] * gscale;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = gs[i];
    // torch.lerp(m, g, w1) switches form at weight 0.5 for accuracy; so do we.
    m[i] = lerp_from_end ? gi - (gi - m[i]) * (1.0f - w1) : m[i] + w1 * (gi - m[i]);
    const float vi = v[i] * b2 + one_minus_b2 * gi * gi;
    v[i] = vi;
    sq[i] = vi;
  }
  sqrt_inplace(sq, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float denom = sq[i] / bc2_sqrt + eps;
    const float pn = p[i] * decay - step_size * (m[i] / denom);
    p[i] = pn;
    if constexpr (kBf16) pb[i] = float_to_bf16(pn);
  }
}

template <bool kBf16>
void adamw_loop(float* p, const float* g, float* m, float* v, bf16* pb, int64_t n, float gscale,
                float decay, float w1, bool lerp_from_end, float b2, float one_minus_b2,
                float step_size, float bc2_sqrt, float eps) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, n - lo);
    adamw_block<kBf16>(p + lo, g + lo, m + lo, v + lo, kBf16 ? pb + lo : nullptr, len, gscale,
                       decay, w1, lerp_from_end, b2, one_minus_b2, step_size, bc2_sqrt, eps);
  }
}

}  // namespace

void adamw_loop_impl(float* p, const float* g, float* m, float* v, bf16* pb, int64_t n,
                     float gscale, float decay, float w1, bool lerp_from_end, float b2,
                     float one_minus_b2, float step_size, float bc2_sqrt, float eps) {
  if (pb != nullptr)
    adamw_loop<true>(p, g, m, v, pb, n, gscale, decay, w1, lerp_from_end, b2, one_minus_b2,
                     step_size, bc2_sqrt, eps);
  else
    adamw_loop<false>(p, g, m, v, nullptr, n, gscale, decay, w1, lerp_from_end, b2, one_minus_b2,
                      step_size, bc2_sqrt, eps);
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {

HWY_EXPORT(adamw_loop_impl);

void check_adamw_args(const AdamWArgs& a, int64_t n) {
  LOOM_CHECK(n >= 0, "adamw_step: element count must be >= 0, got ", n);
  LOOM_CHECK(a.step >= 1, "adamw_step: step must be >= 1 (1-based for bias correction), got ",
             a.step);
  LOOM_CHECK(a.beta1 >= 0 && a.beta1 < 1, "adamw_step: beta1 must be in [0, 1), got ", a.beta1);
  LOOM_CHECK(a.beta2 >= 0 && a.beta2 < 1, "adamw_step: beta2 must be in [0, 1), got ", a.beta2);
  LOOM_CHECK(a.eps > 0, "adamw_step: eps must be > 0, got ", a.eps);
  LOOM_CHECK(a.lr >= 0 && a.weight_decay >= 0,
             "adamw_step: lr and weight_decay must be >= 0, got lr ", a.lr, " and weight_decay ",
             a.weight_decay);
  LOOM_CHECK(std::isfinite(a.grad_scale) && a.grad_scale > 0,
             "adamw_step: grad_scale must be finite and > 0, got ", a.grad_scale);
}

void adamw_step(const AdamWArgs& a, float* param, const float* grad, float* m, float* v, int64_t n,
                bf16* param_bf16) {
  check_adamw_args(a, n);
  const double lr = a.lr, wd = a.weight_decay, b1 = a.beta1, b2 = a.beta2;
  const double bc1 = 1.0 - std::pow(b1, double(a.step));
  const double bc2 = 1.0 - std::pow(b2, double(a.step));
  const float decay = float(1.0 - lr * wd);
  const float w1 = float(1.0 - b1);
  const float step_size = float(lr / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  LOOM_DISPATCH(adamw_loop_impl)
  (param, grad, m, v, param_bf16, n, a.grad_scale, decay, w1, w1 >= 0.5f, a.beta2, float(1.0 - b2),
   step_size, bc2_sqrt, a.eps);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
