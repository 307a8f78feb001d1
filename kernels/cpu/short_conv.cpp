#include "kernels/cpu/short_conv.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/short_conv.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// Channels per work unit: a block's weights, transposed to [W, block], stay in L1, and the inner
// loops run over contiguous channels.
constexpr int64_t kBlock = 64;

inline vf sigmoid(vf x) {
  return 1.0f / (1.0f + vexp(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + vexp(-x));
}

// u[i] = sum_j wt[j][i] x_{t-W+1+j}[i] for the n channels of a block at token t of sample b.
void conv_row(const ShortConv& s, const float* x, int64_t ldx, const float* wt, int64_t b,
              int64_t t, int64_t c0, int64_t n, float* u) {
  std::fill_n(u, n, 0.0f);
  for (int64_t j = std::max<int64_t>(0, s.W - 1 - t); j < s.W; ++j) {
    const float* __restrict xr = x + (b * s.T + t - s.W + 1 + j) * ldx + c0;
    const float* __restrict wj = wt + j * kBlock;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) u[i] += wj[i] * xr[i];
  }
}

void transpose_block(const ShortConv& s, const float* w, int64_t c0, int64_t n, float* wt) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < s.W; ++j) wt[j * kBlock + i] = w[(c0 + i) * s.W + j];
}

}  // namespace

void short_conv_forward_impl(const ShortConv& s, const float* x, int64_t ldx, const float* w,
                             float* y, int64_t ldy) {
  const int64_t blocks = (s.C + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<float> wt(size_t(s.W * kBlock));
    alignas(64) float u[kBlock];
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t bl = 0; bl < blocks; ++bl) {
        const int64_t c0 = bl * kBlock, n = std::min(kBlock, s.C - c0);
        transpose_block(s, w, c0, n, wt.data());
        for (int64_t t = 0; t < s.T; ++t) {
          conv_row(s, x, ldx, wt.data(), b, t, c0, n, u);
          float* yr = y + (b * s.T + t) * ldy + c0;
          int64_t i = 0;
          for (; i + kW <= n; i += kW) {
            const vf ui = load(u + i);
            store(yr + i, ui * sigmoid(ui));
          }
          for (; i < n; ++i) yr[i] = u[i] * sigmoid(u[i]);
        }
      }
  }
}

// du = dy * silu'(u), silu'(u) = s (1 + u (1 - s)) with s = sigmoid(u); then
//   dx_t[c] = sum_j w[c, j] du_{t+W-1-j}[c],   dw[c, j] = sum_t du_t[c] x_{t-W+1+j}[c].
void short_conv_backward_impl(const ShortConv& s, const float* dy, int64_t lddy, const float* x,
                              int64_t ldx, const float* w, float* dx, int64_t lddx, float* dw) {
  const int64_t blocks = (s.C + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<float> wt(size_t(s.W * kBlock)), du(size_t(s.T * kBlock)),
        dwt(size_t(s.W * kBlock));
    alignas(64) float u[kBlock];
    // One unit per channel block, all samples inside it: dw of a channel is then one thread's sum.
#pragma omp for schedule(static)
    for (int64_t bl = 0; bl < blocks; ++bl) {
      const int64_t c0 = bl * kBlock, n = std::min(kBlock, s.C - c0);
      transpose_block(s, w, c0, n, wt.data());
      std::fill(dwt.begin(), dwt.end(), 0.0f);
      for (int64_t b = 0; b < s.B; ++b) {
        for (int64_t t = 0; t < s.T; ++t) {
          conv_row(s, x, ldx, wt.data(), b, t, c0, n, u);
          const float* dyr = dy + (b * s.T + t) * lddy + c0;
          float* dut = du.data() + t * kBlock;
          int64_t i = 0;
          for (; i + kW <= n; i += kW) {
            const vf ui = load(u + i), sg = sigmoid(ui);
            store(dut + i, load(dyr + i) * sg * (1.0f + ui * (1.0f - sg)));
          }
          for (; i < n; ++i) {
            const float sg = sigmoid(u[i]);
            dut[i] = dyr[i] * sg * (1.0f + u[i] * (1.0f - sg));
          }
        }
        for (int64_t t = 0; t < s.T; ++t) {
          float* __restrict dxr = dx + (b * s.T + t) * lddx + c0;
          const float* __restrict xr = x + (b * s.T + t) * ldx + c0;
          std::fill_n(dxr, n, 0.0f);
          // Token t feeds outputs t .. t+W-1, through tap j = W-1-(t'-t) at output t'.
          for (int64_t j = 0; j < s.W; ++j) {
            const int64_t to = t + s.W - 1 - j;
            if (to >= s.T) continue;
            const float* __restrict wj = wt.data() + j * kBlock;
            const float* __restrict dut = du.data() + to * kBlock;
            float* __restrict dwj = dwt.data() + j * kBlock;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
              dxr[i] += wj[i] * dut[i];
              dwj[i] += dut[i] * xr[i];
            }
          }
        }
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < s.W; ++j) dw[(c0 + i) * s.W + j] += dwt[j * kBlock + i];
    }
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_args(const char* what, const ShortConv& s) {
  LOOM_CHECK(s.B >= 0 && s.T >= 0 && s.C > 0 && s.W > 0, what,
             ": need B, T >= 0 and C, W > 0, got B ", s.B, " T ", s.T, " C ", s.C, " W ", s.W);
}
int64_t ld_or(const char* what, const char* name, int64_t ld, int64_t C) {
  LOOM_CHECK(ld == 0 || ld >= C, what, ": row stride of ", name, " is ", ld,
             ", expected 0 (contiguous) or >= ", C);
  return ld ? ld : C;
}

}  // namespace

HWY_EXPORT(short_conv_forward_impl);
HWY_EXPORT(short_conv_backward_impl);

void short_conv_forward(const ShortConv& s, const float* x, int64_t ldx, const float* w, float* y,
                        int64_t ldy) {
  const char* what = "short_conv_forward";
  check_args(what, s);
  LOOM_DISPATCH(short_conv_forward_impl)
  (s, x, ld_or(what, "x", ldx, s.C), w, y, ld_or(what, "y", ldy, s.C));
}

void short_conv_backward(const ShortConv& s, const float* dy, int64_t lddy, const float* x,
                         int64_t ldx, const float* w, float* dx, int64_t lddx, float* dw) {
  const char* what = "short_conv_backward";
  check_args(what, s);
  LOOM_DISPATCH(short_conv_backward_impl)
  (s, dy, ld_or(what, "dy", lddy, s.C), x, ld_or(what, "x", ldx, s.C), w, dx,
   ld_or(what, "dx", lddx, s.C), dw);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
