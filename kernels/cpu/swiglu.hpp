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
// bf16 write. Where avx512_bf16_native() holds the rounding is vcvtneps2bf16's, which flushes an
// f32 denormal to zero, as oneDNN's own bf16 outputs do; every other value has the same bits.
void swiglu_forward(const float* gu, int64_t rows, int64_t F, bf16* h);

// Mixed precision's saved gate/up in bf16: the same arithmetic on the widened inputs (exact), the
// output rounded as above. The backward's gradient is rounded too (only the bf16 GEMMs of the
// gate/up projection read it); dgu may be gu.
void swiglu_forward(const bf16* gu, int64_t rows, int64_t F, bf16* h);
void swiglu_backward(const float* dh, const bf16* gu, int64_t rows, int64_t F, bf16* dgu);

}  // namespace loom::cpu
