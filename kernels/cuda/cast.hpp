#pragma once
// Casts and the small element-wise passes of the optimizer and the gradient norm, on the device
// (the counterparts of kernels/cpu/cast.hpp). Pointers are device memory; the work is queued on
// the compute stream (kernels/cuda/runtime.hpp) and nothing waits for it.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cuda {

// The bits of cpu::cast_f32_to_bf16's software rounding (round to nearest even; denormals kept).
void cast_f32_to_bf16(const float* in, bf16* out, int64_t n);
void cast_bf16_to_f32(const bf16* in, float* out, int64_t n);
void fill(float* x, int64_t n, float value);
// dst[r, :cols] = src[r, :cols] for `rows` rows of the given strides (floats).
void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
               int64_t cols);
void scale_inplace(float* x, int64_t n, float s);
void add_inplace(float* y, const float* x, int64_t n);  // y += x
// *out (device memory, one double) = the sum of x[i]^2 in double, in a fixed order: the same bits
// for the same n whatever the GPU (blocks of a fixed size, partials summed by one block).
// `scratch` holds sum_squares_parts(n) doubles (scratch.hpp).
void sum_squares(const float* x, int64_t n, double* scratch, double* out);

}  // namespace loom::cuda
