#pragma once
// RMSNorm on the device: the counterparts of kernels/cpu/rmsnorm.hpp, with the same arguments,
// the same math and the same bf16 rounding points. Pointers are device memory; the work is queued
// on the compute stream (kernels/cuda/runtime.hpp) and nothing waits for it.
//
// Rows are independent: one block per row, fp32 accumulation. The sum of squares (and the
// backward's dot product) is reduced in a fixed tree that depends only on `dim`, so the outputs
// have the same bits on every run and every GPU; they may differ from the CPU's in the last bits
// (another summation order). No output may alias an input (the CPU kernels' __restrict), except
// rmsnorm_forward_rounding_input's x, which is read and rewritten in place.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cuda {

// y = x / sqrt(mean(x^2) + eps) * w per row of `dim` (x [rows, dim], w [dim]), computed as
// (x * rstd) * w as the CPU does; rstd[r] = 1/sqrt(mean(x_r^2) + eps) saved for the backward.
void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                     float* rstd);
// y rounded to bf16 where the f32 kernel would store it (f32_to_bf16_bits: the CPU's bits of the
// f32 result cast afterwards).
void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, bf16* y,
                     float* rstd);
// Mixed precision's block input in one pass: x rounded to bf16 into x16 and in place (x keeps the
// widened values), then the bf16-output norm of the rounded x: the bits of cast_f32_to_bf16,
// cast_bf16_to_f32 and rmsnorm_forward(bf16 y) in turn. x16 and x are bit for bit the CPU's.
void rmsnorm_forward_rounding_input(float* x, bf16* x16, const float* w, int64_t rows, int64_t dim,
                                    float eps, bf16* y, float* rstd);
// With xhat = x * rstd and g = dy * w:
//   dx += rstd * (g - xhat * mean(g * xhat)),  dw += sum over rows of dy * xhat.
// Both ACCUMULATE, as the CPU's (dx and dw are added to, never overwritten). dw is deterministic:
// each block sums dy * xhat over a fixed range of rows (the ranges depend on `rows` only) into its
// own partial row (scratch from the caching allocator), and a second kernel adds the partials in
// a fixed order, then adds the total to dw. rows == 0 leaves dx and dw as they are.
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw);
// x saved in bf16 (mixed precision's block input), widened (exactly) where it is read: the same
// values as the f32 kernel on the widened copy.
void rmsnorm_backward(const float* dy, const bf16* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw);

}  // namespace loom::cuda
