#pragma once
// GLA's optional short convolution (use_short_conv): a causal depthwise convolution of width W
// over the sequence, then SiLU, per channel, with zero left padding at each sample's start:
//   u[b, t, c] = sum_{j<W} w[c, j] * x[b, t - W + 1 + j, c],   y = u * sigmoid(u)
// (fla's ShortConvolution with activation 'silu' and no bias; w is its [C, 1, W] weight.)
#include <cstdint>

namespace loom::cpu {

struct ShortConv {
  int64_t B = 0, T = 0, C = 0, W = 0;
};

// x [B*T, C] with row stride ldx (0: C), y [B*T, C] with row stride ldy (0: C), w [C, W].
void short_conv_forward(const ShortConv& s, const float* x, int64_t ldx, const float* w, float* y,
                        int64_t ldy);
// dx (row stride lddx, 0: C) overwritten; dw [C, W] accumulated, with the same bits for any
// thread count (each channel's sum runs on one thread in token order). dx must not alias x.
void short_conv_backward(const ShortConv& s, const float* dy, int64_t lddy, const float* x,
                         int64_t ldx, const float* w, float* dx, int64_t lddx, float* dw);

}  // namespace loom::cpu
