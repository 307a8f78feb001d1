#include "model/llama_block.hpp"

#include <cmath>
#include <string>

#include "model/llama_plan.hpp"

namespace loom {

namespace {

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

LlamaBlock::LlamaBlock(const LlamaConfig& c, int64_t layer, bool bf16, Device device,
                       ShardLayout shard, const ParallelContext* par)
    : c_(c),
      par_(par ? par : &no_parallelism()),
      unit_("layers." + std::to_string(layer),
            block_specs(c, layer, par_->tp.opt.rank(), par_->tp.opt.size()), bf16, device, shard) {}

Attention LlamaBlock::attention(const StepContext& ctx) const {
  return Attention::of(*par_, ctx, kNorm1, kQ, kO, Attention::kNone, Attention::kNone,
                       c_.hidden_size, c_.head_dim(), c_.num_attention_heads,
                       c_.num_key_value_heads, float(c_.rms_norm_eps));
}

Mlp LlamaBlock::mlp(const StepContext& ctx) const {
  const Attention at = attention(ctx);
  const int tpn = par_->tp.on() ? par_->tp.opt.size() : 1;
  return {par_->tp, kNorm2,      kGate,
          kDown,    kPrecision,  at.M,
          at.Mx,    at.d,        c_.intermediate_size / tpn,
          at.eps,   ctx.compute, at.keep_gathered};
}

Tensor LlamaBlock::forward(const StepContext& ctx, const Tensor& x, LlamaBlockActs& a) const {
  // In bf16 the residual stream enters each block rounded to bf16, as torch's bf16 mixed
  // precision keeps it, and the block saves that bf16 copy: the saved inputs (all that `full`
  // keeps) take half the memory. The input is rounded in place, so that the forward and its
  // recomputation read the same values; its gradient passes the rounding straight through. The
  // first norm does the rounding in its pass over x.
  const bool round = ctx.compute != DType::f32;
  a.attn.x = round ? Tensor::empty(x.shape(), ctx.compute, x.device()) : x;
  Tensor out = run_forward(ctx, x, a, ac_, true, round);
  if (ac_ == ActivationCheckpoint::Mode::full) {
    // Only the input stays; backward recomputes the rest from it.
    Tensor input = a.attn.x;
    a = LlamaBlockActs();
    a.attn.x = input;
  }
  return out;
}

Tensor LlamaBlock::run_forward(const StepContext& ctx, const Tensor& x, LlamaBlockActs& a,
                               ActivationCheckpoint::Mode mode, bool output,
                               bool round_input) const {
  a.mlp.h = attention(ctx).forward(unit_, ctx, x, a.attn, mode, round_input);
  return mlp(ctx).forward(unit_, a.mlp, mode, output);
}

void LlamaBlock::backward(const StepContext& ctx, Tensor& dy, LlamaBlockActs& a) {
  // `full` saved the input only: the forward runs again (tp and cp communication included),
  // after the unit's before_backward hook, so FSDP has gathered the weights it reads.
  if (!a.mlp.h.defined())
    run_forward(ctx, ops::to_f32(a.attn.x), a, ActivationCheckpoint::Mode::none, false);
  mlp(ctx).backward(unit_, dy, a.mlp);
  attention(ctx).backward(unit_, ctx, dy, a.attn);
  a = LlamaBlockActs();
}

}  // namespace loom
