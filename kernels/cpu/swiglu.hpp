#pragma once
#include <cstdint>

namespace loom::cpu {

// gu is [rows, 2F]: gate in columns [0, F), up in [F, 2F) (the output of one fused GEMM).
// h[r, j] = silu(gate[r, j]) * up[r, j], h is [rows, F].
void swiglu_forward(const float* gu, int64_t rows, int64_t F, float* h);
// dgu [rows, 2F] = gradient w.r.t. gate and up (overwrites). dgu may be gu (in place).
void swiglu_backward(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu);

}  // namespace loom::cpu
