#pragma once
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

// gu is [rows, 2F]: gate in columns [0, F), up in [F, 2F) (the output of one fused GEMM).
// h[r, j] = silu(gate[r, j]) * up[r, j], h is [rows, F].
void swiglu_forward(const float* gu, int64_t rows, int64_t F, float* h);
// dgu [rows, 2F] = gradient w.r.t. gate and up (overwrites). dgu may be gu (in place).
void swiglu_backward(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu);

// h rounded to bf16 (the bits of the f32 kernel followed by cast_f32_to_bf16), for mixed
// precision, where h only feeds a bf16 GEMM: one pass instead of an f32 write, a re-read and a
// bf16 write.
void swiglu_forward(const float* gu, int64_t rows, int64_t F, bf16* h);

}  // namespace loom::cpu
