// The GPU's backend: each op on kernels/cuda (ops/backend.hpp), on the process's compute stream.
// Built only with the CUDA backend (cmake/cuda.cmake). An op without a CUDA kernel would be the
// Backend's error naming it (every op has one now).
//
// The index arrays (tokens, targets, positions) and the RoPE table come as tensors on the device
// (ops::index_tensor, ops::rope_table), and the losses stay on the device (ops::LinearCrossEntropy
// ::loss): nothing here copies host data per call or waits for the GPU, but sum_squares,
// sum_squares_each (the gradient norm's one read a step) and the MoE ops' counts.
#include <algorithm>
#include <cstring>
#include <span>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "kernels/cuda/adamw.hpp"
#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/attention_decode.hpp"
#include "kernels/cuda/bias_gate.hpp"
#include "kernels/cuda/cast.hpp"
#include "kernels/cuda/cross_entropy.hpp"
#include "kernels/cuda/embedding.hpp"
#include "kernels/cuda/gemm.hpp"
#include "kernels/cuda/gla.hpp"
#include "kernels/cuda/gla_ops.hpp"
#include "kernels/cuda/moe.hpp"
#include "kernels/cuda/rmsnorm.hpp"
#include "kernels/cuda/rope.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"
#include "kernels/cuda/swiglu.hpp"
#include "ops/backend.hpp"
#include "ops/shape.hpp"

namespace loom::ops {

namespace {

// The table's device copy, its rows indexed by the positions.
cuda::RopeDeviceTable device_table(const Rope& r) {
  LOOM_CHECK(r.cos.defined() && r.cos.device() == Device::cuda,
             "rope: the rotary table has no copy on the GPU (ops::rope_table(..., Device::cuda))");
  return {r.cos.data<float>(), r.sin.data<float>(), r.host.head_dim, r.host.num_positions};
}

// A block's positions on the device (ops::AttentionBlock), int64.
const int64_t* block_positions(const Tensor* t, const char* name) {
  LOOM_CHECK(t && t->defined() && t->device() == Device::cuda && t->dtype() == DType::i64,
             "attention_block: the ", name,
             " positions need their int64 copy on the GPU (ops::index_tensor)");
  return t->data<int64_t>();
}

cuda::GemmArgs gemm_args(cuda::Trans ta, cuda::Trans tb, int64_t M, int64_t N, int64_t K,
                         const Tensor& a, const Tensor& b, DType ab) {
  cuda::GemmArgs g;
  g.ta = ta, g.tb = tb, g.M = M, g.N = N, g.K = K;
  g.A = a.raw(), g.lda = stride(a);
  g.B = b.raw(), g.ldb = stride(b);
  g.ab = ab;
  return g;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() : Backend(Device::cuda) {}

  double timed(const std::function<void()>& fn) override {
    cuda::EventTimer t;
    t.start();
    fn();
    t.stop();
    return t.elapsed_ms() * 1e-3;
  }

  void cast(const Tensor& src, Tensor& dst) override {
    if (src.dtype() == DType::bf16)
      cuda::cast_bf16_to_f32(src.data<bf16>(), f(dst), src.numel());
    else
      cuda::cast_f32_to_bf16(f(src), dst.data<bf16>(), src.numel());
  }
  void add_inplace(Tensor& y, const Tensor& x) override {
    cuda::add_inplace(f(y), f(x), y.numel());
  }
  void fill(Tensor& x, float value) override { cuda::fill(f(x), x.numel(), value); }
  void copy_rows(const Tensor& src, Tensor& dst) override {
    cuda::copy_rows(f(src), stride(src), f(dst), stride(dst), rows(src), src.size(1));
  }
  // Drawn on the host by the CPU's Philox and copied: the GPU's initial weights are the CPU's to
  // the bit (a device Philox kernel would spare the copy for very large models).
  void philox_normal(Tensor& x, uint64_t key, int64_t first, float std) override {
    Tensor h = Tensor::empty({x.numel()}, DType::f32);
    loom::philox_normal(key, first, x.numel(), 0.0f, std, f(h));
    x.view({x.numel()}).copy_from(h);
  }

  void adamw_step(const AdamWStep& a, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                  Tensor* mirror) override {
    const cuda::AdamWArgs args{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step, a.grad_scale};
    cuda::adamw_step(args, f(p), f(g), f(m), f(v), p.numel(),
                     mirror ? mirror->data<bf16>() : nullptr);
  }
  // Each sum into its slot of one device array, which comes back in one copy (one wait); the
  // scratch of the largest serves every call (the stream orders them).
  void sum_squares_each(std::span<const Tensor> xs, std::span<double> out) override {
    std::vector<int64_t> numels;
    for (const Tensor& x : xs) numels.push_back(x.numel());
    // The scratch a meta run books for the call (scratch.hpp): the largest call's partials, the
    // sums' array.
    const std::vector<cuda::ScratchBlock> blocks = cuda::sum_squares_scratch(numels);
    Tensor scratch = Tensor::empty({blocks[0].numel}, blocks[0].dtype, Device::cuda);
    Tensor sums = Tensor::empty({blocks[1].numel}, blocks[1].dtype, Device::cuda);
    for (size_t i = 0; i < xs.size(); ++i)
      cuda::sum_squares(f(xs[i]), xs[i].numel(), static_cast<double*>(scratch.raw()),
                        static_cast<double*>(sums.raw()) + i);
    const Tensor h = sums.on_host();
    std::memcpy(out.data(), h.raw(), xs.size() * sizeof(double));
  }
  // Read back at once: one synchronization per call (sum_squares_each waits once for many).
  double sum_squares(const Tensor& x) override {
    double s = 0;
    sum_squares_each(std::span<const Tensor>(&x, 1), std::span<double>(&s, 1));
    return s;
  }
  void scale_inplace(Tensor& x, float s) override { cuda::scale_inplace(f(x), x.numel(), s); }

  // y [M, N] (+)= x [M, K] w [N, K]^T; a bf16 y is the product rounded.
  void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::N, cuda::Trans::T, rows(x), cols(y), cols(x), x, w, x.dtype());
    g.ldc = stride(y);
    if (y.dtype() == DType::bf16)
      g.C16 = y.data<bf16>();
    else
      g.C = f(y), g.accumulate = accumulate;
    cuda::gemm(g);
  }
  void linear_residual(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::N, cuda::Trans::T, rows(x), cols(y), cols(x), x, w, x.dtype());
    g.C = f(y), g.ldc = stride(y);
    g.R = f(r), g.ldr = stride(r);
    cuda::gemm(g);
  }
  // dx [M, K] = dy [M, N] w [N, K].
  void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::N, cuda::Trans::N, rows(dy), cols(dx), cols(dy), dy, w, dy.dtype());
    g.C = f(dx), g.ldc = stride(dx);
    cuda::gemm(g);
  }
  // dw [N, K] (+)= dy [M, N]^T x [M, K].
  void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool add) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::T, cuda::Trans::N, cols(dy), cols(x), rows(dy), dy, x, dy.dtype());
    g.C = f(dw), g.ldc = stride(dw), g.accumulate = add;
    cuda::gemm(g);
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                       Tensor& rstd) override {
    if (y.dtype() == DType::bf16)
      cuda::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, y.data<bf16>(), f(rstd));
    else
      cuda::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, f(y), f(rstd));
  }
  void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps, Tensor& y,
                                      Tensor& rstd) override {
    cuda::rmsnorm_forward_rounding_input(f(x), x16.data<bf16>(), f(w), rows(x), w.numel(), eps,
                                         y.data<bf16>(), f(rstd));
  }
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dx, Tensor& dw) override {
    if (x.dtype() == DType::bf16)
      cuda::rmsnorm_backward(f(dy), x.data<bf16>(), f(w), f(rstd), rows(x), w.numel(), f(dx),
                             f(dw));
    else
      cuda::rmsnorm_backward(f(dy), f(x), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw));
  }
  void swiglu_forward(const Tensor& gu, Tensor& act) override {
    if (gu.dtype() == DType::bf16)
      cuda::swiglu_forward(gu.data<bf16>(), rows(gu), cols(act), act.data<bf16>());
    else if (act.dtype() == DType::bf16)
      cuda::swiglu_forward(f(gu), rows(gu), cols(act), act.data<bf16>());
    else
      cuda::swiglu_forward(f(gu), rows(gu), cols(act), f(act));
  }
  void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) override {
    if (gu.dtype() == DType::bf16)
      cuda::swiglu_backward(f(dact), gu.data<bf16>(), rows(gu), cols(dact), dgu.data<bf16>());
    else
      cuda::swiglu_backward(f(dact), f(gu), rows(gu), cols(dact), f(dgu));
  }
  void rope(Tensor& x, int64_t B, int64_t H, const Tensor& positions, const Rope& table,
            bool backward) override {
    const int64_t T = rows(x) / B, D = x.size(1) / H;
    const cuda::RopeDeviceTable t = device_table(table);
    if (backward)
      cuda::rope_backward(f(x), B, T, H, D, stride(x), positions.data<int32_t>(), t);
    else
      cuda::rope_forward(f(x), B, T, H, D, stride(x), positions.data<int32_t>(), t);
  }
  void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc, const Tensor& positions,
                    const Rope& table, bool backward, Tensor& out) override {
    const int64_t T = rows(x) / B, D = x.size(1) / (H + Hc);
    cuda::rope_rounded(f(x), B, T, H, Hc, D, stride(x), positions.data<int32_t>(),
                       device_table(table), backward, out.data<bf16>(), out.size(1));
  }

  void embedding_forward(const Tensor& tokens, const Tensor& table, int64_t v0,
                         Tensor& out) override {
    const int32_t* t = tokens.data<int32_t>();
    if (v0 < 0)
      cuda::embedding_forward(t, rows(out), f(table), rows(table), table.size(1), f(out));
    else
      cuda::embedding_forward_range(t, rows(out), f(table), v0, rows(table), table.size(1), f(out));
  }
  void embedding_backward(const Tensor& tokens, const Tensor& dout, int64_t v0,
                          Tensor& dtable) override {
    const int32_t* t = tokens.data<int32_t>();
    if (v0 < 0)
      cuda::embedding_backward(t, rows(dout), f(dout), rows(dtable), dtable.size(1), f(dtable));
    else
      cuda::embedding_backward_range(t, rows(dout), f(dout), v0, rows(dtable), dtable.size(1),
                                     f(dtable));
  }

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                         int64_t Hkv, Tensor& out, Tensor& lse) override {
    const cpu::AttentionShape s = attention_shape(q, k, B, Hq, Hkv);
    if (q.dtype() == DType::bf16 && out.dtype() == DType::bf16)
      cuda::attention_forward_bf16(s, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(),
                                   out.data<bf16>(), f(lse));
    else if (q.dtype() == DType::bf16)
      cuda::attention_forward_bf16(s, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(), f(out),
                                   f(lse));
    else
      cuda::attention_forward(s, f(q), f(k), f(v), f(out), f(lse));
  }
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    const cpu::AttentionShape s = attention_shape(q, k, B, Hq, Hkv);
    if (q.dtype() == DType::bf16)
      cuda::attention_backward_bf16(s, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(),
                                    out.data<bf16>(), f(lse), f(dout), f(dq), f(dk), f(dv));
    else
      cuda::attention_backward(s, f(q), f(k), f(v), f(out), f(lse), f(dout), f(dq), f(dk), f(dv));
  }
  void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                        int64_t Hkv, Tensor& out) override {
    const int64_t D = q.size(1) / Hq;
    const cpu::DecodeShape s{rows(q), L, Hq, Hkv, D, stride(q), stride(k), scale(D)};
    cuda::attention_decode(s, f(q), f(k), f(v), f(out));
  }
  // Ring attention's blocks: the positions' device copies (made once per micro-batch); `progress`
  // (the CPU kernel's calls between work units, which drive the ring's messages) has nothing to
  // interleave with here, as the GPU runs the block asynchronously.
  void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                               const Tensor& v, Tensor& out, Tensor& lse,
                               const std::function<void()>& /*progress*/) override {
    cuda::attention_block_forward(block_shape(s, q, k), f(q), f(k), f(v),
                                  block_positions(s.q_pos_device, "query"),
                                  block_positions(s.k_pos_device, "key"), f(out), f(lse));
  }
  void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& lse, const Tensor& delta,
                                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                const std::function<void()>& /*progress*/) override {
    cuda::attention_block_backward(
        block_shape(s, q, k), f(q), f(k), f(v), block_positions(s.q_pos_device, "query"),
        block_positions(s.k_pos_device, "key"), f(lse), f(delta), f(dout), f(dq), f(dk), f(dv));
  }
  void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                       const Tensor& lse_b) override {
    cuda::attention_merge(B, rows(out) / B, Hq, out.size(1) / Hq, f(out), f(lse), f(out_b),
                          f(lse_b));
  }
  void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout,
                       Tensor& delta) override {
    cuda::attention_delta(B, rows(out) / B, Hq, out.size(1) / Hq, f(out), f(dout), f(delta));
  }

  void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& gk, const Tensor& h0, Tensor& o, Tensor& ht) override {
    cuda::gla_forward(gla_core(s, q, k, v, gk, h0), {f(o), stride(o)}, f_or_null(ht));
  }
  void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& gk, const Tensor& h0, const Tensor& dout, const Tensor& dht,
                    Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dgk, Tensor& dh0) override {
    cuda::gla_backward(gla_core(s, q, k, v, gk, h0), {f(dout), stride(dout)}, f_or_null(dht),
                       gla_grads(dq, dk, dv, dgk, dh0));
  }
  void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay) override {
    cuda::gla_decay_total(s.B, rows(gk) / s.B, s.Hkv, gk.size(1) / s.Hkv, f(gk), f(decay));
  }
  void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S) override {
    cuda::gla_state_fold(s.B, s.H, s.Hkv, S.size(2), S.size(3), f(decay), f(E), f(S));
  }
  void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer, float clamp_min,
                        Tensor& gk) override {
    cuda::gla_gate_forward(f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min, f(gk));
  }
  void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias, float normalizer,
                         float clamp_min, Tensor& dz, Tensor& dbias) override {
    cuda::gla_gate_backward(f(dgk), f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min,
                            f(dz), bias.defined() ? f(dbias) : nullptr);
  }
  void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w, int64_t heads,
                             float eps, Tensor& y, Tensor& rstd) override {
    const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, eps};
    cuda::gated_rmsnorm_forward(s, f(x), f_or_null(g), g.defined() ? stride(g) : 0, f_or_null(w),
                                f(y), f(rstd));
  }
  void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& w,
                              const Tensor& rstd, int64_t heads, Tensor& dx, Tensor& dg,
                              Tensor& dw) override {
    const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, 0.0f};  // eps is in rstd
    cuda::gated_rmsnorm_backward(s, f(dy), f(x), f_or_null(g), g.defined() ? stride(g) : 0,
                                 f_or_null(w), f(rstd), f(dx), g.defined() ? f(dg) : nullptr,
                                 g.defined() ? stride(dg) : 0, w.defined() ? f(dw) : nullptr);
  }
  void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y) override {
    const cpu::ShortConv s{B, rows(x) / B, x.size(1), w.numel() / x.size(1)};
    cuda::short_conv_forward(s, f(x), stride(x), f(w), f(y), stride(y));
  }
  void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B,
                           Tensor& dx, Tensor& dw) override {
    const cpu::ShortConv s{B, rows(x) / B, x.size(1), w.numel() / x.size(1)};
    cuda::short_conv_backward(s, f(dy), stride(dy), f(x), stride(x), f(w), f(dx), stride(dx),
                              f(dw));
  }

  // Mixture of experts (kernels/cuda/moe.hpp): moe_permute's counts come back to the host (they
  // size the experts' GEMMs), one small copy and wait per call; the other ops queue and return.
  void moe_route(const Tensor& logits, const Tensor& bias, bool renormalize, Tensor& probs,
                 Tensor& experts, Tensor& weights, Tensor& prob_sum) override {
    cuda::moe_route(f(logits), f_or_null(bias), rows(logits), logits.size(1), experts.size(1),
                    renormalize, f(probs), experts.data<int32_t>(), f(weights),
                    f_or_null(prob_sum));
  }
  void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                          const Tensor& dweights, bool renormalize, const Tensor& dprob,
                          Tensor& dlogits) override {
    cuda::moe_route_backward(f(probs), experts.data<int32_t>(), f(weights), f(dweights),
                             rows(probs), probs.size(1), experts.size(1), renormalize,
                             f_or_null(dprob), f(dlogits));
  }
  int64_t moe_permute(const Tensor& experts, int64_t E, std::span<const int64_t> capacity,
                      Tensor& pos, std::vector<int64_t>& counts) override {
    counts.assign(static_cast<size_t>(E), 0);
    return cuda::moe_permute_per_expert(experts.data<int32_t>(), rows(experts), experts.size(1), E,
                                        capacity.empty() ? nullptr : capacity.data(), counts.data(),
                                        pos.data<int32_t>());
  }
  void moe_permute_order(const Tensor& pos, Tensor& order) override {
    cuda::moe_permute_order(pos.data<int32_t>(), pos.numel(), order.numel(), order.data<int32_t>());
  }
  void moe_dispatch(const Tensor& x, const Tensor& order, int64_t k, Tensor& xs) override {
    if (x.dtype() == DType::bf16)
      cuda::moe_dispatch(x.data<bf16>(), rows(x), x.size(1), order.data<int32_t>(), order.numel(),
                         k, xs.data<bf16>());
    else
      cuda::moe_dispatch(f(x), rows(x), x.size(1), order.data<int32_t>(), order.numel(), k, f(xs));
  }
  void moe_dispatch_backward(const Tensor& dxs, const Tensor& pos, int64_t k, Tensor& dx,
                             bool accumulate) override {
    cuda::moe_dispatch_backward(f(dxs), rows(dxs), pos.data<int32_t>(), rows(dx), k, dx.size(1),
                                f(dx), accumulate);
  }
  void moe_combine(const Tensor& ys, const Tensor& weights, const Tensor& pos, Tensor& y) override {
    const int64_t N = rows(ys), M = rows(y), k = weights.size(1), d = y.size(1);
    if (ys.dtype() == DType::bf16)
      cuda::moe_combine(ys.data<bf16>(), N, f(weights), pos.data<int32_t>(), M, k, d, f(y));
    else
      cuda::moe_combine(f(ys), N, f(weights), pos.data<int32_t>(), M, k, d, f(y));
  }
  void moe_combine_backward(const Tensor& dy, const Tensor& ys, const Tensor& weights,
                            const Tensor& pos, Tensor& dys, Tensor& dweights) override {
    const int64_t N = rows(ys), M = rows(dy), k = weights.size(1), d = dy.size(1);
    with_f32_or_bf16(ys, dys, [&](const auto* y, auto* out) {
      cuda::moe_combine_backward(f(dy), y, N, f(weights), pos.data<int32_t>(), M, k, d, out,
                                 f(dweights));
    });
  }

  void add_bias(Tensor& y, const Tensor& b) override {
    cuda::add_bias(f(y), rows(y), y.size(1), stride(y), f(b));
  }
  void bias_grad(const Tensor& dy, Tensor& db) override {
    cuda::bias_grad(f(dy), rows(dy), dy.size(1), stride(dy), f(db));
  }
  void sigmoid_gate_forward(const Tensor& z, const Tensor& ys, Tensor& y) override {
    if (ys.dtype() == DType::bf16)
      cuda::sigmoid_gate_forward(f(z), ys.data<bf16>(), rows(y), y.size(1), f(y));
    else
      cuda::sigmoid_gate_forward(f(z), f(ys), rows(y), y.size(1), f(y));
  }
  void sigmoid_gate_backward(const Tensor& dy, const Tensor& z, const Tensor& ys, Tensor& dys,
                             Tensor& dz) override {
    with_f32_or_bf16(ys, dys, [&](const auto* y, auto* out) {
      cuda::sigmoid_gate_backward(f(dy), f(z), y, rows(dy), dy.size(1), out, f(dz));
    });
  }

  // The summed loss stays on the device (a.loss), read back with the step's others.
  void linear_cross_entropy(const LinearCrossEntropy& a, bool dw_overwrite) override {
    cuda::LinearCrossEntropyArgs ce;
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
    // The targets were checked on the host where they were made (ops::index_tensor,
    // Model::micro_batch): the kernel's own check (one >= V is never used as an index) is raised
    // at the next wait, the step's loss read, rather than waited for here.
    cuda::linear_cross_entropy_checked_later(ce, a.loss.data<double>());
  }
  void vocab_shard_lse(const Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                       Tensor& lse, Tensor& target_logit) override {
    cuda::vocab_shard_lse(f(logits), rows(logits), cols(logits), Vr, targets.data<int32_t>(), v0,
                          f(lse), f(target_logit));
  }
  void vocab_shard_combine(const Tensor& lse_all, const Tensor& targets, const Tensor& target_logit,
                           Tensor& glse, Tensor& loss) override {
    cuda::vocab_shard_combine(f(lse_all), int(rows(lse_all)), cols(lse_all),
                              targets.data<int32_t>(), f(target_logit), f(glse),
                              loss.data<double>());
  }
  void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                           const Tensor& glse, float grad_scale) override {
    cuda::vocab_shard_dlogits(f(logits), rows(logits), cols(logits), Vr, targets.data<int32_t>(),
                              v0, f(glse), grad_scale);
  }
};

}  // namespace

Backend& cuda_backend() {
  static CudaBackend b;
  return b;
}

}  // namespace loom::ops
