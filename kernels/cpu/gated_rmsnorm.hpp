#pragma once
// GLA's output norm: RMSNorm over each head's `dim` values with one weight [dim] shared by all
// heads, times swish of the output gate (fla's FusedRMSNormGated):
//   y[m, h, :] = x[m, h, :] * rstd[m, h] * w * g * sigmoid(g),  rstd = (mean(x^2) + eps)^-1/2
// Without a gate (use_output_gate false) the swish factor is 1; without a weight
// (elementwise_affine false) w is 1.
#include <cstdint>

namespace loom::cpu {

struct GatedRmsNorm {
  int64_t rows = 0, heads = 0, dim = 0;
  float eps = 0;
};

// x, y [rows, heads*dim] contiguous; g [rows, heads*dim] with row stride ldg (0: contiguous) or
// null; w [dim] or null; rstd [rows*heads] written.
void gated_rmsnorm_forward(const GatedRmsNorm& s, const float* x, const float* g, int64_t ldg,
                           const float* w, float* y, float* rstd);
// dx overwritten; dg (layout of g) overwritten when g is given; dw [dim] accumulated when w is
// given, with the same bits for any thread count.
void gated_rmsnorm_backward(const GatedRmsNorm& s, const float* dy, const float* x, const float* g,
                            int64_t ldg, const float* w, const float* rstd, float* dx, float* dg,
                            int64_t lddg, float* dw);

}  // namespace loom::cpu
