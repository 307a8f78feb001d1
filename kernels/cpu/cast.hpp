#pragma once
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

void cast_f32_to_bf16(const float* in, bf16* out, int64_t n);
void cast_bf16_to_f32(const bf16* in, float* out, int64_t n);
// Sum of squares in double (for the global gradient norm).
double sum_squares(const float* x, int64_t n);
void scale_inplace(float* x, int64_t n, float s);
void add_inplace(float* y, const float* x, int64_t n);  // y += x

}  // namespace loom::cpu
