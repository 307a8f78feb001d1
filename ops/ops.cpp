#include "ops/ops.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cpu/attention_decode.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/sharded.hpp"
#include "kernels/cpu/swiglu.hpp"

namespace loom::ops {

namespace {

// Runs the cpu kernel `fn` on the cpu device; meta books memory only (nothing to compute).
template <class Fn>
void on(const char* op, Device device, Fn&& fn) {
  switch (device) {
    case Device::cpu:
      fn();
      return;
    case Device::meta:
      return;
    default:
      fail(op, ": no kernel for device ", device_name(device));
  }
}

const float* f(const Tensor& t) {
  return t.data<float>();
}
float* f(Tensor& t) {
  return t.data<float>();
}
int64_t rows(const Tensor& t) {
  return t.size(0);
}
int64_t cols(const Tensor& t) {
  return t.numel() / t.size(0);
}
int64_t stride(const Tensor& t) {
  return t.ndim() > 1 ? t.strides()[0] : t.numel();
}
float scale(int64_t D) {
  return 1.0f / std::sqrt(float(D));
}

}  // namespace

bool computes(Device device) {
  return device != Device::meta;
}

Tensor to_compute(const Tensor& x, DType dt) {
  if (dt == DType::f32) return x;
  Tensor y = Tensor::empty(x.shape(), DType::bf16, x.device());
  cast(x, y);
  return y;
}

void cast(const Tensor& src, Tensor& dst) {
  LOOM_CHECK(src.numel() == dst.numel(), "cast: ", src.numel(), " elements into ", dst.numel());
  on("cast", src.device(), [&] { cpu::cast_f32_to_bf16(f(src), dst.data<bf16>(), src.numel()); });
}

void add_inplace(Tensor& y, const Tensor& x) {
  LOOM_CHECK(y.numel() == x.numel(), "add_inplace: ", x.numel(), " elements into ", y.numel());
  on("add_inplace", y.device(), [&] { cpu::add_inplace(f(y), f(x), y.numel()); });
}

void fill(Tensor& x, float value) {
  on("fill", x.device(), [&] { cpu::fill(f(x), x.numel(), value); });
}

void copy_rows(const Tensor& src, Tensor& dst) {
  LOOM_CHECK(rows(src) == rows(dst) && src.size(1) == dst.size(1),
             "copy_rows: ", shape_str(src.shape()), " into ", shape_str(dst.shape()));
  on("copy_rows", src.device(),
     [&] { cpu::copy_rows(f(src), stride(src), f(dst), stride(dst), rows(src), src.size(1)); });
}

void philox_normal(Tensor& x, uint64_t key, int64_t first, float std) {
  on("philox_normal", x.device(),
     [&] { loom::philox_normal(key, first, x.numel(), 0.0f, std, f(x)); });
}

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  on("linear", y.device(), [&] {
    cpu::linear_forward(x.raw(), w.raw(), f(y), rows(x), cols(y), cols(x), x.dtype(), accumulate);
  });
}

void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dw, Tensor& dx) {
  on("linear_backward", dy.device(), [&] {
    const int64_t M = rows(dy), N = cols(dy), K = cols(x);
    cpu::linear_backward_input(dy.raw(), w.raw(), f(dx), M, N, K, dy.dtype(), false);
    cpu::linear_backward_weight(dy.raw(), x.raw(), f(dw), M, N, K, dy.dtype());
  });
}

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  on("rmsnorm_forward", x.device(),
     [&] { cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, f(y), f(rstd)); });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  on("rmsnorm_backward", x.device(),
     [&] { cpu::rmsnorm_backward(f(dy), f(x), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw)); });
}

void swiglu_forward(const Tensor& gu, Tensor& act) {
  on("swiglu_forward", gu.device(),
     [&] { cpu::swiglu_forward(f(gu), rows(gu), cols(act), f(act)); });
}

void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) {
  on("swiglu_backward", gu.device(),
     [&] { cpu::swiglu_backward(f(dact), f(gu), rows(gu), cols(dact), f(dgu)); });
}

void rope_forward(Tensor& x, int64_t B, int64_t H, const std::vector<int32_t>& positions,
                  const RopeTable& table) {
  on("rope_forward", x.device(), [&] {
    const int64_t T = rows(x) / B;
    cpu::rope_forward(f(x), B, T, H, x.size(1) / H, stride(x), positions.data(), table);
  });
}

void rope_backward(Tensor& dx, int64_t B, int64_t H, const std::vector<int32_t>& positions,
                   const RopeTable& table) {
  on("rope_backward", dx.device(), [&] {
    const int64_t T = rows(dx) / B;
    cpu::rope_backward(f(dx), B, T, H, dx.size(1) / H, stride(dx), positions.data(), table);
  });
}

RopeTable rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s) {
  // A host table: every backend's rope kernel reads positions' cos/sin from it.
  return cpu::rope_table(head_dim, num_positions, theta, s);
}

void embedding_forward(const int32_t* tokens, const Tensor& table, Tensor& out) {
  on("embedding_forward", out.device(), [&] {
    cpu::embedding_forward(tokens, rows(out), f(table), rows(table), table.size(1), f(out));
  });
}

void embedding_backward(const int32_t* tokens, const Tensor& dout, Tensor& dtable) {
  on("embedding_backward", dout.device(), [&] {
    cpu::embedding_backward(tokens, rows(dout), f(dout), rows(dtable), dtable.size(1), f(dtable));
  });
}

void embedding_forward_range(const int32_t* tokens, const Tensor& table, int64_t v0, Tensor& out) {
  on("embedding_forward_range", out.device(), [&] {
    cpu::embedding_forward_range(tokens, rows(out), f(table), v0, rows(table), table.size(1),
                                 f(out));
  });
}

void embedding_backward_range(const int32_t* tokens, const Tensor& dout, int64_t v0,
                              Tensor& dtable) {
  on("embedding_backward_range", dout.device(), [&] {
    cpu::embedding_backward_range(tokens, rows(dout), f(dout), v0, rows(dtable), dtable.size(1),
                                  f(dtable));
  });
}

namespace {

cpu::AttentionShape attention_shape(const Tensor& q, const Tensor& k, int64_t B, int64_t Hq,
                                    int64_t Hkv) {
  const int64_t D = q.size(1) / Hq;
  return {B, rows(q) / B, Hq, Hkv, D, stride(q), stride(k), scale(D)};
}

cpu::BlockShape block_shape(const AttentionBlock& s, const Tensor& q, const Tensor& k) {
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

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                       int64_t Hkv, Tensor& out, Tensor& lse) {
  on("attention_forward", q.device(), [&] {
    cpu::attention_forward(attention_shape(q, k, B, Hq, Hkv), f(q), f(k), f(v), f(out), f(lse));
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
  on("attention_backward", q.device(), [&] {
    cpu::attention_backward(attention_shape(q, k, B, Hq, Hkv), f(q), f(k), f(v), f(out), f(lse),
                            f(dout), f(dq), f(dk), f(dv));
  });
}

void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                      int64_t Hkv, Tensor& out) {
  on("attention_decode", q.device(), [&] {
    const int64_t D = q.size(1) / Hq;
    cpu::DecodeShape s{rows(q), L, Hq, Hkv, D, stride(q), stride(k), scale(D)};
    cpu::attention_decode(s, f(q), f(k), f(v), f(out));
  });
}

void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                             const Tensor& v, Tensor& out, Tensor& lse,
                             const std::function<void()>& progress) {
  on("attention_block_forward", q.device(), [&] {
    cpu::attention_block_forward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                 s.k_pos->data(), f(out), f(lse), progress);
  });
}

void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& lse, const Tensor& delta,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const std::function<void()>& progress) {
  on("attention_block_backward", q.device(), [&] {
    cpu::attention_block_backward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                  s.k_pos->data(), f(lse), f(delta), f(dout), f(dq), f(dk), f(dv),
                                  progress);
  });
}

void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b) {
  on("attention_merge", out.device(), [&] {
    const int64_t T = rows(out) / B;
    cpu::attention_merge(B, T, Hq, out.size(1) / Hq, f(out), f(lse), f(out_b), f(lse_b));
  });
}

void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout, Tensor& delta) {
  on("attention_delta", out.device(), [&] {
    const int64_t T = rows(out) / B;
    cpu::attention_delta(B, T, Hq, out.size(1) / Hq, f(out), f(dout), f(delta));
  });
}

double linear_cross_entropy(const LinearCrossEntropy& a) {
  double loss = 0;
  on("linear_cross_entropy", a.x.device(), [&] {
    cpu::LinearCrossEntropyArgs ce;
    ce.x = a.x.raw();
    ce.w = a.w.raw();
    ce.ab = a.x.dtype();
    ce.targets = a.targets;
    ce.N = rows(a.x);
    ce.D = cols(a.x);
    ce.V = a.V;
    ce.grad_scale = a.grad_scale;
    ce.dx = a.dx.defined() ? a.dx.data<float>() : nullptr;
    ce.dw = a.dw.defined() ? a.dw.data<float>() : nullptr;
    ce.chunk_rows = a.chunk_rows;
    loss = cpu::linear_cross_entropy(ce);
  });
  return loss;
}

void vocab_shard_lse(const Tensor& logits, int64_t Vr, const int32_t* targets, int64_t v0,
                     Tensor& lse, Tensor& target_logit) {
  on("vocab_shard_lse", logits.device(), [&] {
    cpu::vocab_shard_lse(f(logits), rows(logits), cols(logits), Vr, targets, v0, f(lse),
                         f(target_logit));
  });
}

double vocab_shard_combine(const Tensor& lse_all, const int32_t* targets,
                           const Tensor& target_logit, Tensor& glse) {
  double loss = 0;
  on("vocab_shard_combine", lse_all.device(), [&] {
    loss = cpu::vocab_shard_combine(f(lse_all), int(rows(lse_all)), cols(lse_all), targets,
                                    f(target_logit), f(glse));
  });
  return loss;
}

void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const int32_t* targets, int64_t v0,
                         const Tensor& glse, float grad_scale) {
  on("vocab_shard_dlogits", logits.device(), [&] {
    cpu::vocab_shard_dlogits(f(logits), rows(logits), cols(logits), Vr, targets, v0, f(glse),
                             grad_scale);
  });
}

}  // namespace loom::ops
