#pragma once
// How the ops and their backends read a tensor as a matrix: rows along dim 0, the rest as
// columns, and the row stride of a strided 2-D view (q, k or v inside a fused qkv buffer).
#include <cstdint>

#include "core/tensor.hpp"

namespace loom::ops {

inline int64_t rows(const Tensor& t) {
  return t.size(0);
}
inline int64_t cols(const Tensor& t) {
  return t.numel() / t.size(0);
}
inline int64_t stride(const Tensor& t) {
  return t.ndim() > 1 ? t.strides()[0] : t.numel();
}
// The f32 data of a tensor (a dtype check in Tensor::data).
inline const float* f(const Tensor& t) {
  return t.data<float>();
}
inline float* f(Tensor& t) {
  return t.data<float>();
}

}  // namespace loom::ops
