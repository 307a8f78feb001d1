#pragma once
// SwiGLU on the device: the counterparts of kernels/cpu/swiglu.hpp, with the same arguments, the
// same expressions and the same bf16 rounding points. Pointers are device memory; the work is
// queued on the compute stream (kernels/cuda/runtime.hpp) and nothing waits for it.
//
// gu is [rows, 2F]: gate in columns [0, F), up in [F, 2F) (the output of one fused GEMM), h is
// [rows, F]. sigmoid(g) = 1 / (1 + exp(-g)) with CUDA's expf (not the CPU's own exp: the f32
// results may differ from the CPU's in the last bits). bf16 outputs are rounded by
// f32_to_bf16_bits (round to nearest even, denormals kept: the CPU's software rounding; the CPU's
// vcvtneps2bf16 path flushes f32 denormals, the GPU never does).
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cuda {

// h[r, j] = (g * sigmoid(g)) * u with g = gu[r, j], u = gu[r, F + j]. h must not overlap gu.
void swiglu_forward(const float* gu, int64_t rows, int64_t F, float* h);
// h rounded to bf16 (mixed precision: only a bf16 GEMM reads it).
void swiglu_forward(const float* gu, int64_t rows, int64_t F, bf16* h);
// Mixed precision's saved gate/up in bf16: the same arithmetic on the widened (exact) inputs.
void swiglu_forward(const bf16* gu, int64_t rows, int64_t F, bf16* h);

// dgu [rows, 2F] = the gradient w.r.t. gate and up (OVERWRITES dgu): with s = sigmoid(g),
//   dgate = ((dh * u) * s) * (1 + g * (1 - s)),  dup = (dh * g) * s.
// dgu may be gu itself (in place, as the model overwrites the saved gate/up): every element of gu
// is read by the one thread that then writes the same element of dgu, so no element is read after
// it was overwritten. Any other overlap of dgu with gu, and any overlap with dh, is not allowed.
void swiglu_backward(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu);
// bf16 gate/up in, the gradient rounded to bf16 out (only the bf16 GEMMs of the gate/up
// projection read it); dgu may be gu.
void swiglu_backward(const float* dh, const bf16* gu, int64_t rows, int64_t F, bf16* dgu);

}  // namespace loom::cuda
