#include "model/llama_block.hpp"

#include <cmath>
#include <string>

#include "model/llama_plan.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

std::vector<ParamSpec> block_specs(const LlamaConfig& c, int64_t layer, int tp_rank, int tp) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t d = c.hidden_size, hd = c.head_dim(), F = c.intermediate_size / tp;
  const int64_t q = c.num_attention_heads / tp * hd, kv = c.num_key_value_heads / tp * hd;
  // Output projections of the residual branches start smaller (GPT-2 / Megatron scaled init), so
  // the residual stream's variance does not grow with depth.
  const float out_std = 0.02f / std::sqrt(2.0f * float(c.num_hidden_layers));
  std::vector<ParamSpec> specs{
      {p + "input_layernorm.weight", {d}, Init::ones, 0, false, true},
      {p + "self_attn.q_proj.weight", {q, d}, Init::normal, 0.02f, true, false},
      {p + "self_attn.k_proj.weight", {kv, d}, Init::normal, 0.02f, true, false},
      {p + "self_attn.v_proj.weight", {kv, d}, Init::normal, 0.02f, true, false},
      {p + "self_attn.o_proj.weight", {d, q}, Init::normal, out_std, true, false},
      {p + "post_attention_layernorm.weight", {d}, Init::ones, 0, false, true},
      {p + "mlp.gate_proj.weight", {F, d}, Init::normal, 0.02f, true, false},
      {p + "mlp.up_proj.weight", {F, d}, Init::normal, 0.02f, true, false},
      {p + "mlp.down_proj.weight", {d, F}, Init::normal, out_std, true, false},
  };
  for (auto& sp : specs) {
    sp.split = split_of(llama_plan(), sp.name);
    sp.tp_rank = tp_rank;
    sp.tp_count = tp;
    sp.gemm_grad = !sp.f32_value;  // the projections; the norms' kernel adds to its gradient
  }
  return specs;
}

}  // namespace

size_t LlamaBlockActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&x, &rstd1, &xn1, &qkv, &attn, &lse})
    if (t->defined()) n += t->nbytes();
  return n + mlp.bytes();
}

// This tp rank's sizes of one micro-batch.
struct LlamaBlock::Dims {
  int64_t M, Mx, d, hd, Hq, Hkv, F, nqkv;
  float eps;
};

LlamaBlock::LlamaBlock(const LlamaConfig& c, int64_t layer, bool bf16, Device device,
                       ShardLayout shard, const ParallelContext* par)
    : c_(c),
      par_(par ? par : &no_parallelism()),
      unit_("layers." + std::to_string(layer),
            block_specs(c, layer, par_->tp.opt.rank(), par_->tp.opt.size()), bf16, device, shard) {}

LlamaBlock::Dims LlamaBlock::dims(const StepContext& ctx) const {
  const TpRuntime& tp = par_->tp;
  const int tpn = tp.on() ? tp.opt.size() : 1;
  Dims g;
  g.M = ctx.tokens();
  g.Mx = tp.sp() ? g.M / tpn : g.M;  // rows of the block's input and output
  g.d = c_.hidden_size;
  g.hd = c_.head_dim();
  g.Hq = c_.num_attention_heads / tpn;
  g.Hkv = c_.num_key_value_heads / tpn;
  g.F = c_.intermediate_size / tpn;
  g.nqkv = (g.Hq + 2 * g.Hkv) * g.hd;
  g.eps = float(c_.rms_norm_eps);
  return g;
}

Mlp LlamaBlock::mlp(const StepContext& ctx) const {
  const Dims g = dims(ctx);
  return {par_->tp, kNorm2, kGate, kDown, kPrecision,  g.M,
          g.Mx,     g.d,    g.F,   g.eps, ctx.compute, keep_gathered()};
}

Tensor LlamaBlock::forward(const StepContext& ctx, const Tensor& x, LlamaBlockActs& a) const {
  // In bf16 the residual stream enters each block rounded to bf16, as torch's bf16 mixed
  // precision keeps it, and the block saves that bf16 copy: the saved inputs (all that `full`
  // keeps) take half the memory. The input is rounded in place, so that the forward and its
  // recomputation read the same values; its gradient passes the rounding straight through. The
  // first norm does the rounding in its pass over x.
  const bool round = ctx.compute != DType::f32;
  a.x = round ? Tensor::empty(x.shape(), ctx.compute, x.device()) : x;
  Tensor out = run_forward(ctx, x, a, ac_, true, round);
  if (ac_ == ActivationCheckpoint::Mode::full) {
    // Only the input stays; backward recomputes the rest from it.
    Tensor input = a.x;
    a = LlamaBlockActs();
    a.x = input;
  }
  return out;
}

// RoPE on q and k, then causal attention (ring attention across cp ranks). qkv is the f32 GEMM
// output; a.qkv and a.attn keep it and the attention output in the compute dtype. In bf16 the
// attention reads qkv rounded, so that its backward (which reads the saved bf16 copy)
// differentiates the function the forward computed: the bf16 kernels read that copy itself;
// ring attention (f32 kernels) reads qkv rounded in place.
void LlamaBlock::attention(const StepContext& ctx, Tensor& qkv, LlamaBlockActs& a) const {
  const Dims g = dims(ctx);
  const Device dev = qkv.device();
  const bool ring = par_->cp.size() > 1, bf16 = ctx.compute == DType::bf16;
  // The bf16 kernels write the attention output rounded, what is saved; ring attention's merge
  // needs it in f32 (rounded after).
  Tensor attn = bf16 && !ring ? Tensor::empty({g.M, g.Hq * g.hd}, DType::bf16, dev)
                              : f32({g.M, g.Hq * g.hd}, dev);
  {
    if (bf16 && !ring) {
      // The bf16 kernels read only the rounded copy: q and k rotated as they are rounded.
      a.qkv = Tensor::empty({g.M, g.nqkv}, DType::bf16, dev);
      ops::rope_rounded(qkv, ctx.B, g.Hq + g.Hkv, g.Hkv, ctx.positions, *ctx.rope, false, a.qkv);
    } else {
      Tensor q = qkv.narrow(1, 0, g.Hq * g.hd), k = qkv.narrow(1, g.Hq * g.hd, g.Hkv * g.hd);
      ops::rope_forward(q, ctx.B, g.Hq, ctx.positions, *ctx.rope);
      ops::rope_forward(k, ctx.B, g.Hkv, ctx.positions, *ctx.rope);
      a.qkv = ops::to_compute(qkv, ctx.compute);
      if (ctx.compute != DType::f32 && ring) ops::cast(a.qkv, qkv);
    }
    a.lse = f32({ctx.B, g.Hq, ctx.T}, dev);
    const Tensor& in = bf16 && !ring ? a.qkv : qkv;
    if (ring)
      ring_attention_forward(par_->cp, {ctx.B, ctx.T, g.Hq, g.Hkv, g.hd, &ctx.cp_pos}, qkv, attn,
                             a.lse);
    else
      ops::attention_forward(in.narrow(1, 0, g.Hq * g.hd), in.narrow(1, g.Hq * g.hd, g.Hkv * g.hd),
                             in.narrow(1, (g.Hq + g.Hkv) * g.hd, g.Hkv * g.hd), ctx.B, g.Hq, g.Hkv,
                             attn, a.lse);
  }
  qkv = Tensor();  // the f32 copy goes before the rounded output is made
  a.attn = attn.dtype() == ctx.compute ? attn : ops::to_compute(attn, ctx.compute);
}

// In bf16 without cp, dq and dk come out not yet rotated back: the caller rotates them as it rounds
// dqkv for the GEMM (unrotated_dqkv).
bool LlamaBlock::unrotated_dqkv(const StepContext& ctx) const {
  return par_->cp.size() == 1 && ctx.compute == DType::bf16;
}

void LlamaBlock::attention_backward(const StepContext& ctx, LlamaBlockActs& a, const Tensor& dattn,
                                    Tensor& dqkv) const {
  const Dims g = dims(ctx);
  const int64_t qc = g.Hq * g.hd, kc = g.Hkv * g.hd;
  Tensor dq = dqkv.narrow(1, 0, qc), dk = dqkv.narrow(1, qc, kc), dv = dqkv.narrow(1, qc + kc, kc);
  if (unrotated_dqkv(ctx)) {
    // The bf16 kernels read the saved bf16 qkv and attention output themselves.
    ops::attention_backward(a.qkv.narrow(1, 0, qc), a.qkv.narrow(1, qc, kc),
                            a.qkv.narrow(1, qc + kc, kc), a.attn, a.lse, dattn, ctx.B, g.Hq, g.Hkv,
                            dq, dk, dv);
    a.qkv = Tensor();
    a.attn = Tensor();
    return;
  }
  // Ring attention's kernels read f32: the saved bf16 copies widened (exactly), each freed as soon
  // as it is.
  const Tensor qkv = ops::to_f32(a.qkv);
  a.qkv = Tensor();
  const Tensor attn = ops::to_f32(a.attn);
  a.attn = Tensor();
  if (par_->cp.size() > 1)
    ring_attention_backward(par_->cp, {ctx.B, ctx.T, g.Hq, g.Hkv, g.hd, &ctx.cp_pos}, qkv, attn,
                            a.lse, dattn, dqkv);
  else
    ops::attention_backward(qkv.narrow(1, 0, qc), qkv.narrow(1, qc, kc), qkv.narrow(1, qc + kc, kc),
                            attn, a.lse, dattn, ctx.B, g.Hq, g.Hkv, dq, dk, dv);
  ops::rope_backward(dq, ctx.B, g.Hq, ctx.positions, *ctx.rope);
  ops::rope_backward(dk, ctx.B, g.Hkv, ctx.positions, *ctx.rope);
}

Tensor LlamaBlock::run_forward(const StepContext& ctx, const Tensor& x, LlamaBlockActs& a,
                               ActivationCheckpoint::Mode mode, bool output,
                               bool round_input) const {
  const TpRuntime& tp = par_->tp;
  const Dims g = dims(ctx);
  const auto& P = unit_.params();
  const Device dev = x.device();
  const DType dt = ctx.compute;
  // `op` drops the norm and SwiGLU outputs after their GEMM; backward recomputes them (and,
  // with SP, gathers the norm outputs again, as with recompute_allgather). Neither `op` nor
  // `full` keeps a gathered GEMM input: it goes to the pooled buffer.
  const bool op = mode == ActivationCheckpoint::Mode::op;
  const bool keep_gathered = this->keep_gathered() && mode == ActivationCheckpoint::Mode::none;

  a.rstd1 = f32({g.Mx}, dev);
  {
    // In bf16 the norm rounds its output itself: the GEMM reads only the bf16 copy.
    Tensor xn1 = Tensor::empty({g.Mx, g.d}, dt, dev);
    if (round_input) {
      Tensor rounded = x;
      ops::rmsnorm_forward_rounding_input(rounded, a.x, P[kNorm1].value, g.eps, xn1, a.rstd1);
    } else {
      ops::rmsnorm_forward(x, P[kNorm1].value, g.eps, xn1, a.rstd1);
    }
    Tensor qkv = f32({g.M, g.nqkv}, dev);
    column_parallel_forward(tp, xn1, weight(kQ), keep_gathered, a.xn1, qkv);
    if (op) a.xn1 = Tensor();
    attention(ctx, qkv, a);
  }
  a.mlp.h = row_parallel_forward(tp, a.attn, weight(kO), x);
  return mlp(ctx).forward(unit_, a.mlp, mode, output);
}

void LlamaBlock::backward(const StepContext& ctx, Tensor& dy, LlamaBlockActs& a) {
  const TpRuntime& tp = par_->tp;
  const Dims g = dims(ctx);
  auto& P = unit_.params();
  const Device dev = dy.device();
  const DType dt = ctx.compute;
  // `full` saved the input only: the forward runs again (tp and cp communication included),
  // after the unit's before_backward hook, so FSDP has gathered the weights it reads.
  if (!a.mlp.h.defined())
    run_forward(ctx, ops::to_f32(a.x), a, ActivationCheckpoint::Mode::none, false);
  mlp(ctx).backward(unit_, dy, a.mlp);
  // Attention branch: h = x + o(attention(rope(qkv(norm1(x))))).
  {
    Tensor dqkv = f32({g.M, g.nqkv}, dev);
    {
      Tensor dattn = f32({g.M, g.Hq * g.hd}, dev);
      row_parallel_backward(tp, dy, a.attn, weight(kO), unit_.weight_grad(kO), dattn, dt);
      attention_backward(ctx, a, dattn, dqkv);
      a.lse = Tensor();
    }
    // The saved input as the forward read it: the bf16 copy, read widened (exactly) by the norm's
    // backward; widened here only where the norm output must be recomputed from it.
    const Tensor x = a.xn1.defined() ? a.x : ops::to_f32(a.x);
    a.x = Tensor();
    Tensor dqkv_c;
    if (unrotated_dqkv(ctx)) {
      dqkv_c = Tensor::empty({g.M, g.nqkv}, DType::bf16, dev);
      ops::rope_rounded(dqkv, ctx.B, g.Hq + g.Hkv, g.Hkv, ctx.positions, *ctx.rope, true, dqkv_c);
    } else {
      dqkv_c = ops::to_compute(dqkv, dt);
    }
    Tensor dxn1 = column_parallel_backward(
        tp, dqkv_c,
        norm_gemm_input(tp, kPrecision, dt, a.xn1, keep_gathered(), x, P[kNorm1].value, g.eps),
        weight(kQ), unit_.weight_grad(kQ, 3));
    dqkv_c = Tensor();
    dqkv = Tensor();
    a.xn1 = Tensor();
    tp_summed_norm_grad(tp, P[kNorm1].grad, [&](Tensor& gw) {
      ops::rmsnorm_backward(dxn1, x, P[kNorm1].value, a.rstd1, dy, gw);
    });
  }
  a = LlamaBlockActs();
}

}  // namespace loom
