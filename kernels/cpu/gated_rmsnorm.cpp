#include "kernels/cpu/gated_rmsnorm.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gated_rmsnorm.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

constexpr int64_t kParallelMin = int64_t{1} << 14;
// dw is summed per chunk of rows and the partials added in chunk order (as rmsnorm's dw): the
// chunking depends only on `rows`, so the bits do not depend on the thread count.
constexpr int64_t kMaxChunks = 64;

inline float sigmoid(float x) {
  return 1.0f / (1.0f + vexp(-x));
}
inline vf sigmoid(vf x) {
  return 1.0f / (1.0f + vexp(-x));
}

}  // namespace

void gated_rmsnorm_forward_impl(const GatedRmsNorm& s, const float* x, const float* g, int64_t ldg,
                                const float* w, float* y, float* rstd) {
  const int64_t D = s.dim, HD = s.heads * D;
  const float inv_dim = 1.0f / float(D);
#pragma omp parallel for schedule(static) if (s.rows * HD >= kParallelMin)
  for (int64_t m = 0; m < s.rows; ++m)
    for (int64_t h = 0; h < s.heads; ++h) {
      const float* __restrict xr = x + m * HD + h * D;
      float* __restrict yr = y + m * HD + h * D;
      float ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float rs = 1.0f / std::sqrt(ss * inv_dim + s.eps);
      rstd[m * s.heads + h] = rs;
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * rs * (w ? w[i] : 1.0f);
      if (!g) continue;
      const float* gr = g + m * ldg + h * D;
      int64_t i = 0;
      for (; i + kW <= D; i += kW) {
        const vf gi = load(gr + i);
        store(yr + i, load(yr + i) * gi * sigmoid(gi));
      }
      for (; i < D; ++i) yr[i] *= gr[i] * sigmoid(gr[i]);
    }
}

// With n = x rstd, sw = g sigmoid(g), y = n w sw:
//   dg = dy n w sigmoid(g) (1 + g (1 - sigmoid(g))),  dn = dy w sw,
//   dx = rstd (dn - n mean(dn n)),  dw = sum over rows and heads of dy n sw.
void gated_rmsnorm_backward_impl(const GatedRmsNorm& s, const float* dy, const float* x,
                                 const float* g, int64_t ldg, const float* w, const float* rstd,
                                 float* dx, float* dg, int64_t lddg, float* dw) {
  const int64_t D = s.dim, HD = s.heads * D;
  const int64_t chunk_rows = std::max<int64_t>(1, (s.rows + kMaxChunks - 1) / kMaxChunks);
  const int64_t chunks = (s.rows + chunk_rows - 1) / chunk_rows;
  std::vector<float> partial(size_t(chunks * D), 0.0f);
  const float inv_dim = 1.0f / float(D);
#pragma omp parallel if (s.rows * HD >= kParallelMin)
  {
    std::vector<float> dn(static_cast<size_t>(D)), sw(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      float* __restrict pw = partial.data() + c * D;
      const int64_t m_end = std::min(s.rows, (c + 1) * chunk_rows);
      for (int64_t m = c * chunk_rows; m < m_end; ++m)
        for (int64_t h = 0; h < s.heads; ++h) {
          const float* __restrict xr = x + m * HD + h * D;
          const float* __restrict dyr = dy + m * HD + h * D;
          float* __restrict dxr = dx + m * HD + h * D;
          const float rs = rstd[m * s.heads + h];
          if (g) {
            const float* gr = g + m * ldg + h * D;
            float* dgr = dg + m * lddg + h * D;
            int64_t i = 0;
            for (; i + kW <= D; i += kW) {
              const vf gi = load(gr + i), sg = sigmoid(gi);
              const vf wn = load(xr + i) * rs * (w ? load(w + i) : splat(1.0f));
              store(dgr + i, load(dyr + i) * wn * sg * (1.0f + gi * (1.0f - sg)));
              store(sw.data() + i, gi * sg);
            }
            for (; i < D; ++i) {
              const float gi = gr[i], sg = sigmoid(gi);
              const float wn = xr[i] * rs * (w ? w[i] : 1.0f);
              dgr[i] = dyr[i] * wn * sg * (1.0f + gi * (1.0f - sg));
              sw[i] = gi * sg;
            }
          } else {
            std::fill(sw.begin(), sw.end(), 1.0f);
          }
          float dot = 0;  // sum(dn * n)
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < D; ++i) {
            dn[i] = dyr[i] * (w ? w[i] : 1.0f) * sw[i];
            dot += dn[i] * xr[i] * rs;
          }
          const float k = dot * inv_dim;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) {
            const float n = xr[i] * rs;
            dxr[i] = rs * (dn[i] - n * k);
            pw[i] += dyr[i] * n * sw[i];
          }
        }
    }
  }
  if (!w) return;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* __restrict pc = partial.data() + c * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) dw[i] += pc[i];
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_args(const char* what, const GatedRmsNorm& s, const float* g, int64_t ldg) {
  LOOM_CHECK(s.rows >= 0 && s.heads > 0 && s.dim > 0, what,
             ": need rows >= 0, heads > 0 and dim > 0, got ", s.rows, ", ", s.heads, ", ", s.dim);
  LOOM_CHECK(s.eps >= 0, what, ": eps must be >= 0, got ", s.eps);
  LOOM_CHECK(!g || ldg >= s.heads * s.dim, what, ": row stride of the gate is ", ldg,
             ", expected >= ", s.heads * s.dim);
}

}  // namespace

HWY_EXPORT(gated_rmsnorm_forward_impl);
HWY_EXPORT(gated_rmsnorm_backward_impl);

void gated_rmsnorm_forward(const GatedRmsNorm& s, const float* x, const float* g, int64_t ldg,
                           const float* w, float* y, float* rstd) {
  if (ldg == 0) ldg = s.heads * s.dim;
  check_args("gated_rmsnorm_forward", s, g, ldg);
  LOOM_DISPATCH(gated_rmsnorm_forward_impl)(s, x, g, ldg, w, y, rstd);
}

void gated_rmsnorm_backward(const GatedRmsNorm& s, const float* dy, const float* x, const float* g,
                            int64_t ldg, const float* w, const float* rstd, float* dx, float* dg,
                            int64_t lddg, float* dw) {
  if (ldg == 0) ldg = s.heads * s.dim;
  if (lddg == 0) lddg = s.heads * s.dim;
  check_args("gated_rmsnorm_backward", s, g, ldg);
  check_args("gated_rmsnorm_backward", s, g ? dg : nullptr, lddg);
  LOOM_DISPATCH(gated_rmsnorm_backward_impl)(s, dy, x, g, ldg, w, rstd, dx, dg, lddg, dw);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
