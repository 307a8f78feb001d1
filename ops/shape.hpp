#pragma once
// How the ops and their backends read a tensor as a matrix: rows along dim 0, the rest as
// columns, and the row stride of a strided 2-D view (q, k or v inside a fused qkv buffer).
#include <cmath>
#include <cstdint>

#include "core/tensor.hpp"
#include "kernels/cpu/attention.hpp"        // AttentionShape: a plain struct, every backend's
#include "kernels/cpu/attention_block.hpp"  // BlockShape, likewise
#include "ops/ops.hpp"

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

// The attention's softmax scale, 1/sqrt(head dim).
inline float scale(int64_t D) {
  return 1.0f / std::sqrt(float(D));
}
// The shapes of the attention kernels, from the tensors (q, k may be strided views).
inline cpu::AttentionShape attention_shape(const Tensor& q, const Tensor& k, int64_t B, int64_t Hq,
                                           int64_t Hkv) {
  const int64_t D = q.size(1) / Hq;
  return {B, rows(q) / B, Hq, Hkv, D, stride(q), stride(k), scale(D)};
}
inline cpu::BlockShape block_shape(const AttentionBlock& s, const Tensor& q, const Tensor& k) {
  const int64_t D = q.size(1) / s.Hq;
  return {s.B,
          int64_t(s.q_pos->size()),
          int64_t(s.k_pos->size()),
          s.Hq,
          s.Hkv,
          D,
          stride(q),
          stride(k),
          scale(D)};
}

}  // namespace loom::ops
