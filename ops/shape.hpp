#pragma once
// How the ops and their backends read a tensor as a matrix: rows along dim 0, the rest as
// columns, and the row stride of a strided 2-D view (q, k or v inside a fused qkv buffer).
#include <cmath>
#include <cstdint>

#include "core/tensor.hpp"
#include "kernels/cpu/attention.hpp"        // AttentionShape: a plain struct, every backend's
#include "kernels/cpu/attention_block.hpp"  // BlockShape, likewise
#include "kernels/cpu/gla.hpp"              // GlaCore, GlaCoreGrads, likewise
#include "ops/ops.hpp"

namespace loom::ops {

inline int64_t rows(const Tensor& t) {
  return t.size(0);
}
// The elements of a row (a tensor of no rows, an expert that got no token, has them too).
inline int64_t cols(const Tensor& t) {
  int64_t n = 1;
  for (size_t i = 1; i < t.shape().size(); ++i) n *= t.shape()[i];
  return n;
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

inline float* f_or_null(Tensor& t) {
  return t.defined() ? f(t) : nullptr;
}
inline const float* f_or_null(const Tensor& t) {
  return t.defined() ? f(t) : nullptr;
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

// The GLA core's arguments from the tensors (strided views).
inline cpu::GlaCore gla_core(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& gk, const Tensor& h0) {
  cpu::GlaCore a;
  a.B = s.B, a.T = rows(q) / s.B, a.H = s.H, a.Hkv = s.Hkv;
  a.K = q.size(1) / s.H, a.V = v.size(1) / s.Hkv;
  a.scale = scale(a.K);
  a.chunk = s.chunk, a.sub_chunk = s.sub_chunk;
  a.q = {f(q), stride(q)}, a.k = {f(k), stride(k)}, a.v = {f(v), stride(v)};
  a.gk = {f(gk), stride(gk)};
  a.h0 = h0.defined() ? f(h0) : nullptr;
  return a;
}
inline cpu::GlaCoreGrads gla_grads(Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dgk, Tensor& dh0) {
  return {{f(dq), stride(dq)},
          {f(dk), stride(dk)},
          {f(dv), stride(dv)},
          {f(dgk), stride(dgk)},
          f_or_null(dh0)};
}

}  // namespace loom::ops
