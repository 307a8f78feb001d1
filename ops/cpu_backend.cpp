// The CPU's backend: each op on kernels/cpu (ops/backend.hpp). The ops have checked the
// arguments; this file picks the kernel by dtype and passes the tensors' pointers and strides.
#include <cmath>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "kernels/cpu/adamw.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_bf16.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cpu/attention_decode.hpp"
#include "kernels/cpu/bias_gate.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gated_rmsnorm.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/gla.hpp"
#include "kernels/cpu/gla_gate.hpp"
#include "kernels/cpu/moe.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/rope.hpp"
#include "kernels/cpu/sharded.hpp"
#include "kernels/cpu/short_conv.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "ops/backend.hpp"
#include "ops/shape.hpp"

namespace loom::ops {

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend() : Backend(Device::cpu) {}

  void cast(const Tensor& src, Tensor& dst) override {
    if (src.dtype() == DType::bf16)
      cpu::cast_bf16_to_f32(src.data<bf16>(), f(dst), src.numel());
    else
      cpu::cast_f32_to_bf16(f(src), dst.data<bf16>(), src.numel());
  }
  void add_inplace(Tensor& y, const Tensor& x) override { cpu::add_inplace(f(y), f(x), y.numel()); }
  void fill(Tensor& x, float value) override { cpu::fill(f(x), x.numel(), value); }
  void copy_rows(const Tensor& src, Tensor& dst) override {
    cpu::copy_rows(f(src), stride(src), f(dst), stride(dst), rows(src), src.size(1));
  }
  void philox_normal(Tensor& x, uint64_t key, int64_t first, float std) override {
    loom::philox_normal(key, first, x.numel(), 0.0f, std, f(x));
  }

  void adamw_step(const AdamWStep& a, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                  Tensor* mirror) override {
    const cpu::AdamWArgs args{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step, a.grad_scale};
    cpu::adamw_step(args, f(p), f(g), f(m), f(v), p.numel(),
                    mirror ? mirror->data<bf16>() : nullptr);
  }
  double sum_squares(const Tensor& x) override { return cpu::sum_squares(f(x), x.numel()); }
  void scale_inplace(Tensor& x, float s) override { cpu::scale_inplace(f(x), x.numel(), s); }

  void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) override {
    if (y.dtype() == DType::bf16)
      cpu::linear_forward_rounded(x.raw(), w.raw(), y.data<bf16>(), rows(x), cols(y), cols(x),
                                  x.dtype());
    else
      cpu::linear_forward(x.raw(), w.raw(), f(y), rows(x), cols(y), cols(x), x.dtype(), accumulate);
  }
  void linear_residual(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y) override {
    cpu::linear_forward_residual(x.raw(), w.raw(), f(r), f(y), rows(x), cols(y), cols(x),
                                 x.dtype());
  }
  void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    cpu::linear_backward_input(dy.raw(), w.raw(), f(dx), rows(dy), cols(dy), cols(dx), dy.dtype(),
                               false);
  }
  void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool add) override {
    cpu::linear_backward_weight(dy.raw(), x.raw(), f(dw), rows(dy), cols(dy), cols(x), dy.dtype(),
                                add);
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                       Tensor& rstd) override {
    if (y.dtype() == DType::bf16)
      cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, y.data<bf16>(), f(rstd));
    else
      cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, f(y), f(rstd));
  }
  void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps, Tensor& y,
                                      Tensor& rstd) override {
    cpu::rmsnorm_forward_rounding_input(f(x), x16.data<bf16>(), f(w), rows(x), w.numel(), eps,
                                        y.data<bf16>(), f(rstd));
  }
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dx, Tensor& dw) override {
    if (x.dtype() == DType::bf16)
      cpu::rmsnorm_backward(f(dy), x.data<bf16>(), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw));
    else
      cpu::rmsnorm_backward(f(dy), f(x), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw));
  }
  void swiglu_forward(const Tensor& gu, Tensor& act) override {
    if (gu.dtype() == DType::bf16)
      cpu::swiglu_forward(gu.data<bf16>(), rows(gu), cols(act), act.data<bf16>());
    else if (act.dtype() == DType::bf16)
      cpu::swiglu_forward(f(gu), rows(gu), cols(act), act.data<bf16>());
    else
      cpu::swiglu_forward(f(gu), rows(gu), cols(act), f(act));
  }
  void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) override {
    if (gu.dtype() == DType::bf16)
      cpu::swiglu_backward(f(dact), gu.data<bf16>(), rows(gu), cols(dact), dgu.data<bf16>());
    else
      cpu::swiglu_backward(f(dact), f(gu), rows(gu), cols(dact), f(dgu));
  }
  void rope(Tensor& x, int64_t B, int64_t H, const Tensor& positions, const Rope& table,
            bool backward) override {
    const int64_t T = rows(x) / B, D = x.size(1) / H;
    if (backward)
      cpu::rope_backward(f(x), B, T, H, D, stride(x), positions.data<int32_t>(), table.host);
    else
      cpu::rope_forward(f(x), B, T, H, D, stride(x), positions.data<int32_t>(), table.host);
  }
  void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc, const Tensor& positions,
                    const Rope& table, bool backward, Tensor& out) override {
    const int64_t T = rows(x) / B, D = x.size(1) / (H + Hc);
    cpu::rope_rounded(f(x), B, T, H, Hc, D, stride(x), positions.data<int32_t>(), table.host,
                      backward, out.data<bf16>(), out.size(1));
  }

  void embedding_forward(const Tensor& tokens, const Tensor& table, int64_t v0,
                         Tensor& out) override {
    if (v0 < 0)
      cpu::embedding_forward(tokens.data<int32_t>(), rows(out), f(table), rows(table),
                             table.size(1), f(out));
    else
      cpu::embedding_forward_range(tokens.data<int32_t>(), rows(out), f(table), v0, rows(table),
                                   table.size(1), f(out));
  }
  void embedding_backward(const Tensor& tokens, const Tensor& dout, int64_t v0,
                          Tensor& dtable) override {
    if (v0 < 0)
      cpu::embedding_backward(tokens.data<int32_t>(), rows(dout), f(dout), rows(dtable),
                              dtable.size(1), f(dtable));
    else
      cpu::embedding_backward_range(tokens.data<int32_t>(), rows(dout), f(dout), v0, rows(dtable),
                                    dtable.size(1), f(dtable));
  }

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                         int64_t Hkv, Tensor& out, Tensor& lse) override {
    const cpu::AttentionShape s = attention_shape(q, k, B, Hq, Hkv);
    if (q.dtype() == DType::bf16 && out.dtype() == DType::bf16)
      cpu::attention_forward_bf16(s, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(),
                                  out.data<bf16>(), f(lse));
    else if (q.dtype() == DType::bf16)
      cpu::attention_forward_bf16(s, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(), f(out),
                                  f(lse));
    else
      cpu::attention_forward(s, f(q), f(k), f(v), f(out), f(lse));
  }
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    const cpu::AttentionShape s = attention_shape(q, k, B, Hq, Hkv);
    if (q.dtype() == DType::bf16)
      cpu::attention_backward_bf16(s, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(),
                                   out.data<bf16>(), f(lse), f(dout), f(dq), f(dk), f(dv));
    else
      cpu::attention_backward(s, f(q), f(k), f(v), f(out), f(lse), f(dout), f(dq), f(dk), f(dv));
  }
  void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                        int64_t Hkv, Tensor& out) override {
    const int64_t D = q.size(1) / Hq;
    const cpu::DecodeShape s{rows(q), L, Hq, Hkv, D, stride(q), stride(k), scale(D)};
    cpu::attention_decode(s, f(q), f(k), f(v), f(out));
  }
  void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                               const Tensor& v, Tensor& out, Tensor& lse,
                               const std::function<void()>& progress) override {
    cpu::attention_block_forward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                 s.k_pos->data(), f(out), f(lse), progress);
  }
  void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& lse, const Tensor& delta,
                                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                const std::function<void()>& progress) override {
    cpu::attention_block_backward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                  s.k_pos->data(), f(lse), f(delta), f(dout), f(dq), f(dk), f(dv),
                                  progress);
  }
  void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                       const Tensor& lse_b) override {
    const int64_t T = rows(out) / B;
    cpu::attention_merge(B, T, Hq, out.size(1) / Hq, f(out), f(lse), f(out_b), f(lse_b));
  }
  void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout,
                       Tensor& delta) override {
    const int64_t T = rows(out) / B;
    cpu::attention_delta(B, T, Hq, out.size(1) / Hq, f(out), f(dout), f(delta));
  }

  void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& gk, const Tensor& h0, Tensor& o, Tensor& ht) override {
    cpu::gla_forward(gla_core(s, q, k, v, gk, h0), {f(o), stride(o)}, f_or_null(ht));
  }
  void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& gk, const Tensor& h0, const Tensor& dout, const Tensor& dht,
                    Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dgk, Tensor& dh0) override {
    cpu::gla_backward(gla_core(s, q, k, v, gk, h0), {f(dout), stride(dout)}, f_or_null(dht),
                      gla_grads(dq, dk, dv, dgk, dh0));
  }
  void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay) override {
    cpu::gla_decay_total(s.B, rows(gk) / s.B, s.Hkv, gk.size(1) / s.Hkv, f(gk), f(decay));
  }
  void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S) override {
    cpu::gla_state_fold(s.B, s.H, s.Hkv, S.size(2), S.size(3), f(decay), f(E), f(S));
  }
  void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer, float clamp_min,
                        Tensor& gk) override {
    cpu::gla_gate_forward(f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min, f(gk));
  }
  void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias, float normalizer,
                         float clamp_min, Tensor& dz, Tensor& dbias) override {
    cpu::gla_gate_backward(f(dgk), f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min,
                           f(dz), bias.defined() ? f(dbias) : nullptr);
  }
  void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w, int64_t heads,
                             float eps, Tensor& y, Tensor& rstd) override {
    const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, eps};
    cpu::gated_rmsnorm_forward(s, f(x), f_or_null(g), g.defined() ? stride(g) : 0, f_or_null(w),
                               f(y), f(rstd));
  }
  void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& w,
                              const Tensor& rstd, int64_t heads, Tensor& dx, Tensor& dg,
                              Tensor& dw) override {
    const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, 0.0f};  // eps is in rstd
    cpu::gated_rmsnorm_backward(s, f(dy), f(x), f_or_null(g), g.defined() ? stride(g) : 0,
                                f_or_null(w), f(rstd), f(dx), g.defined() ? f(dg) : nullptr,
                                g.defined() ? stride(dg) : 0, w.defined() ? f(dw) : nullptr);
  }
  void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y) override {
    const int64_t C = x.size(1);
    const cpu::ShortConv s{B, rows(x) / B, C, w.numel() / C};
    cpu::short_conv_forward(s, f(x), stride(x), f(w), f(y), stride(y));
  }
  void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B,
                           Tensor& dx, Tensor& dw) override {
    const int64_t C = x.size(1);
    const cpu::ShortConv s{B, rows(x) / B, C, w.numel() / C};
    cpu::short_conv_backward(s, f(dy), stride(dy), f(x), stride(x), f(w), f(dx), stride(dx), f(dw));
  }

  void moe_route(const Tensor& logits, const Tensor& bias, bool renormalize, Tensor& probs,
                 Tensor& experts, Tensor& weights, Tensor& prob_sum) override {
    cpu::moe_route(f(logits), f_or_null(bias), rows(logits), logits.size(1), experts.size(1),
                   renormalize, f(probs), experts.data<int32_t>(), f(weights), f_or_null(prob_sum));
  }
  void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                          const Tensor& dweights, bool renormalize, const Tensor& dprob,
                          Tensor& dlogits) override {
    cpu::moe_route_backward(f(probs), experts.data<int32_t>(), f(weights), f(dweights), rows(probs),
                            probs.size(1), experts.size(1), renormalize, f_or_null(dprob),
                            f(dlogits));
  }
  int64_t moe_permute(const Tensor& experts, int64_t E, std::span<const int64_t> capacity,
                      Tensor& pos, std::vector<int64_t>& counts) override {
    counts.assign(static_cast<size_t>(E), 0);
    return cpu::moe_permute_per_expert(experts.data<int32_t>(), rows(experts), experts.size(1), E,
                                       capacity.empty() ? nullptr : capacity.data(), counts.data(),
                                       pos.data<int32_t>());
  }
  void moe_permute_order(const Tensor& pos, Tensor& order) override {
    cpu::moe_permute_order(pos.data<int32_t>(), pos.numel(), order.numel(), order.data<int32_t>());
  }
  void moe_dispatch(const Tensor& x, const Tensor& order, int64_t k, Tensor& xs) override {
    if (x.dtype() == DType::bf16)
      cpu::moe_dispatch(x.data<bf16>(), rows(x), x.size(1), order.data<int32_t>(), order.numel(), k,
                        xs.data<bf16>());
    else
      cpu::moe_dispatch(f(x), rows(x), x.size(1), order.data<int32_t>(), order.numel(), k, f(xs));
  }
  void moe_dispatch_backward(const Tensor& dxs, const Tensor& pos, int64_t k, Tensor& dx,
                             bool accumulate) override {
    cpu::moe_dispatch_backward(f(dxs), rows(dxs), pos.data<int32_t>(), rows(dx), k, dx.size(1),
                               f(dx), accumulate);
  }
  void moe_combine(const Tensor& ys, const Tensor& weights, const Tensor& pos, Tensor& y) override {
    const int64_t N = rows(ys), M = rows(y), k = weights.size(1), d = y.size(1);
    if (ys.dtype() == DType::bf16)
      cpu::moe_combine(ys.data<bf16>(), N, f(weights), pos.data<int32_t>(), M, k, d, f(y));
    else
      cpu::moe_combine(f(ys), N, f(weights), pos.data<int32_t>(), M, k, d, f(y));
  }
  void moe_combine_backward(const Tensor& dy, const Tensor& ys, const Tensor& weights,
                            const Tensor& pos, Tensor& dys, Tensor& dweights) override {
    const int64_t N = rows(ys), M = rows(dy), k = weights.size(1), d = dy.size(1);
    with_f32_or_bf16(ys, dys, [&](const auto* y, auto* out) {
      cpu::moe_combine_backward(f(dy), y, N, f(weights), pos.data<int32_t>(), M, k, d, out,
                                f(dweights));
    });
  }

  void add_bias(Tensor& y, const Tensor& b) override {
    cpu::add_bias(f(y), rows(y), y.size(1), stride(y), f(b));
  }
  void bias_grad(const Tensor& dy, Tensor& db) override {
    cpu::bias_grad(f(dy), rows(dy), dy.size(1), stride(dy), f(db));
  }
  void sigmoid_gate_forward(const Tensor& z, const Tensor& ys, Tensor& y) override {
    if (ys.dtype() == DType::bf16)
      cpu::sigmoid_gate_forward(f(z), ys.data<bf16>(), rows(y), y.size(1), f(y));
    else
      cpu::sigmoid_gate_forward(f(z), f(ys), rows(y), y.size(1), f(y));
  }
  void sigmoid_gate_backward(const Tensor& dy, const Tensor& z, const Tensor& ys, Tensor& dys,
                             Tensor& dz) override {
    with_f32_or_bf16(ys, dys, [&](const auto* y, auto* out) {
      cpu::sigmoid_gate_backward(f(dy), f(z), y, rows(dy), dy.size(1), out, f(dz));
    });
  }

  void linear_cross_entropy(const LinearCrossEntropy& a, bool dw_overwrite) override {
    cpu::LinearCrossEntropyArgs ce;
    ce.x = a.x.raw();
    ce.w = a.w.raw();
    ce.ab = a.x.dtype();
    ce.targets = a.targets.data<int32_t>();
    ce.N = rows(a.x);
    ce.D = cols(a.x);
    ce.V = a.V;
    ce.grad_scale = a.grad_scale;
    ce.dx = a.dx.defined() ? a.dx.data<float>() : nullptr;
    ce.dw = a.dw.t.defined() ? a.dw.t.data<float>() : nullptr;
    ce.dw_overwrite = dw_overwrite;
    ce.chunk_rows = a.chunk_rows;
    ce.grad_rows = a.grad_rows;
    a.loss.data<double>()[0] = cpu::linear_cross_entropy(ce);
  }
  void vocab_shard_lse(const Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                       Tensor& lse, Tensor& target_logit) override {
    cpu::vocab_shard_lse(f(logits), rows(logits), cols(logits), Vr, targets.data<int32_t>(), v0,
                         f(lse), f(target_logit));
  }
  void vocab_shard_combine(const Tensor& lse_all, const Tensor& targets, const Tensor& target_logit,
                           Tensor& glse, Tensor& loss) override {
    loss.data<double>()[0] =
        cpu::vocab_shard_combine(f(lse_all), int(rows(lse_all)), cols(lse_all),
                                 targets.data<int32_t>(), f(target_logit), f(glse));
  }
  void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                           const Tensor& glse, float grad_scale) override {
    cpu::vocab_shard_dlogits(f(logits), rows(logits), cols(logits), Vr, targets.data<int32_t>(), v0,
                             f(glse), grad_scale);
  }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend b;
  return b;
}

}  // namespace loom::ops
