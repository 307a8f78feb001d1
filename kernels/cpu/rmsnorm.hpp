#pragma once
#include <cstdint>

namespace loom::cpu {

// y = x / sqrt(mean(x^2) + eps) * w, per row of `dim`. rstd[r] = 1/sqrt(mean(x_r^2) + eps) is
// saved for backward.
void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                     float* rstd);
// dx += d/dx, dw += d/dw (both accumulate; dw deterministic for a given thread count).
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw);

}  // namespace loom::cpu
