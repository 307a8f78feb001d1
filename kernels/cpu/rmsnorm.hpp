#pragma once
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

// y = x / sqrt(mean(x^2) + eps) * w, per row of `dim`. rstd[r] = 1/sqrt(mean(x_r^2) + eps) is
// saved for backward.
void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                     float* rstd);
// y rounded to bf16 (the bits of the f32 kernel followed by cast_f32_to_bf16), for mixed
// precision, where the norm's output only feeds a bf16 GEMM.
void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, bf16* y,
                     float* rstd);
// Mixed precision's block input in one pass: x rounded to bf16 into x16 and in place (x keeps the
// widened values), then the bf16-output norm of the rounded x. The bits of cast_f32_to_bf16(x ->
// x16), cast_bf16_to_f32(x16 -> x) and rmsnorm_forward(x, ..., bf16 y), without the two passes.
void rmsnorm_forward_rounding_input(float* x, bf16* x16, const float* w, int64_t rows, int64_t dim,
                                    float eps, bf16* y, float* rstd);
// dx += d/dx, dw += d/dw (both accumulate; dw deterministic for a given thread count).
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw);
// x saved in bf16 (mixed precision's block input), read as the f32 kernel reads its widened copy:
// the same bits, without the copy.
void rmsnorm_backward(const float* dy, const bf16* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw);

}  // namespace loom::cpu
