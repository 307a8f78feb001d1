#include "model/moe_block.hpp"

#include <cmath>
#include <string>

#include "core/error.hpp"
#include "model/moe_plan.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

// Each parameter split as the plan says (on one tp rank: the style only; the model refuses tp > 1).
std::vector<ParamSpec> with_plan(std::vector<ParamSpec> specs) {
  for (ParamSpec& s : specs) s.split = split_of(moe_plan(), s.name);
  return specs;
}

// The block's parameters in Hugging Face's names, in the unit's order: the attention's, then the
// FFN's. A sparse layer's experts: each expert's gate and up adjacent (one fused GEMM matrix),
// expert by expert, then the down projections.
std::vector<ParamSpec> block_specs(const MoeConfig& c, int64_t layer, bool sparse) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const LlamaConfig& b = c.base;
  const int64_t d = b.hidden_size, hd = c.head_dim;
  const int64_t q = b.num_attention_heads * hd, kv = b.num_key_value_heads * hd;
  // Output projections of the residual branches start smaller (GPT-2 / Megatron scaled init).
  const float out_std = 0.02f / std::sqrt(2.0f * float(b.num_hidden_layers));
  auto norm = [](std::string name, int64_t n) {
    return ParamSpec{std::move(name), {n}, Init::ones, 0, false, true};
  };
  auto gemm = [](std::string name, int64_t rows, int64_t cols, float std) {
    ParamSpec s{std::move(name), {rows, cols}, Init::normal, std, true, false};
    s.gemm_grad = true;
    return s;
  };
  std::vector<ParamSpec> specs{norm(p + "input_layernorm.weight", d),
                               gemm(p + "self_attn.q_proj.weight", q, d, 0.02f),
                               gemm(p + "self_attn.k_proj.weight", kv, d, 0.02f),
                               gemm(p + "self_attn.v_proj.weight", kv, d, 0.02f),
                               gemm(p + "self_attn.o_proj.weight", d, q, out_std)};
  if (c.qk_norm()) {
    specs.push_back(norm(p + "self_attn.q_norm.weight", hd));
    specs.push_back(norm(p + "self_attn.k_norm.weight", hd));
  }
  specs.push_back(norm(p + "post_attention_layernorm.weight", d));
  if (!sparse) {
    const int64_t F = b.intermediate_size;
    specs.push_back(gemm(p + "mlp.gate_proj.weight", F, d, 0.02f));
    specs.push_back(gemm(p + "mlp.up_proj.weight", F, d, 0.02f));
    specs.push_back(gemm(p + "mlp.down_proj.weight", d, F, out_std));
    return with_plan(std::move(specs));
  }
  const bool mixtral = c.family == MoeConfig::Family::mixtral;
  const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
  const int64_t F = c.moe_intermediate_size, E = c.num_experts;
  specs.push_back(gemm(moe + "gate.weight", E, d, 0.02f));
  // An expert that gets no token writes no gradient: the experts' gradients are zeroed each step
  // and their GEMMs add (ParamSpec::gemm_grad false).
  auto expert = [&](int64_t e, const char* qwen, const char* mix, int64_t rows, int64_t cols,
                    float std) {
    ParamSpec s =
        gemm(moe + "experts." + std::to_string(e) + "." + (mixtral ? mix : qwen) + ".weight", rows,
             cols, std);
    s.gemm_grad = false;
    return s;
  };
  for (int64_t e = 0; e < E; ++e) {
    specs.push_back(expert(e, "gate_proj", "w1", F, d, 0.02f));
    specs.push_back(expert(e, "up_proj", "w3", F, d, 0.02f));
  }
  for (int64_t e = 0; e < E; ++e) specs.push_back(expert(e, "down_proj", "w2", d, F, out_std));
  return with_plan(std::move(specs));
}

}  // namespace

MoeBlock::MoeBlock(const MoeConfig& c, int64_t layer, bool bf16, Device device, ShardLayout shard,
                   const ParallelContext* par)
    : c_(c),
      par_(par ? par : &no_parallelism()),
      sparse_(c.sparse(layer)),
      norm2_(c.qk_norm() ? 7 : 5),
      unit_("layers." + std::to_string(layer), block_specs(c, layer, sparse_), bf16, device,
            shard) {
  // Tensor parallelism splits no MoE parameter yet (docs/decisions/moe.md).
  LOOM_CHECK(!par_->tp.on() || par_->tp.opt.size() == 1,
             "parallelism.tp: a mixture-of-experts model (", c.model_type(),
             ") runs without tensor parallelism for now (expected parallelism.tp = 1)");
}

Attention MoeBlock::attention(const StepContext& ctx) const {
  return Attention::of(*par_, ctx, 0, 1, 4, c_.qk_norm() ? 5 : Attention::kNone,
                       c_.base.hidden_size, c_.head_dim, c_.base.num_attention_heads,
                       c_.base.num_key_value_heads, float(c_.base.rms_norm_eps));
}

Mlp MoeBlock::mlp(const StepContext& ctx) const {
  const Attention at = attention(ctx);
  return {par_->tp,   norm2_,      norm2_ + 1,
          norm2_ + 3, kPrecision,  at.M,
          at.Mx,      at.d,        c_.base.intermediate_size,
          at.eps,     ctx.compute, at.keep_gathered};
}

MoeFfn MoeBlock::moe(const StepContext& ctx) const {
  const int64_t E = c_.num_experts;
  return {.norm = norm2_,
          .router = norm2_ + 1,
          .gate = norm2_ + 2,
          .down = norm2_ + 2 + 2 * size_t(E),
          .M = ctx.tokens(),
          .d = c_.base.hidden_size,
          .E = E,
          .k = c_.num_experts_per_tok,
          .F = c_.moe_intermediate_size,
          .renormalize = c_.norm_topk_prob,
          .capacity = 0,
          .eps = float(c_.base.rms_norm_eps),
          .compute = ctx.compute};
}

Tensor MoeBlock::forward(const StepContext& ctx, const Tensor& x, MoeBlockActs& a,
                         RouterStats& stats) const {
  // In bf16 the residual stream enters each block rounded to bf16 (as LlamaBlock::forward).
  const bool round = ctx.compute != DType::f32;
  a.attn.x = round ? Tensor::empty(x.shape(), ctx.compute, x.device()) : x;
  Tensor out = run_forward(ctx, x, a, ac_, true, stats, round);
  if (ac_ == ActivationCheckpoint::Mode::full) {
    Tensor input = a.attn.x;
    a = MoeBlockActs();
    a.attn.x = input;
  }
  return out;
}

Tensor MoeBlock::run_forward(const StepContext& ctx, const Tensor& x, MoeBlockActs& a,
                             ActivationCheckpoint::Mode mode, bool output, RouterStats& stats,
                             bool round_input) const {
  Tensor h = attention(ctx).forward(unit_, ctx, x, a.attn, mode, round_input);
  if (!sparse_) {
    a.mlp.h = h;
    return mlp(ctx).forward(unit_, a.mlp, mode, output);
  }
  a.moe.h = h;
  return moe(ctx).forward(unit_, a.moe, stats, output);
}

void MoeBlock::backward(const StepContext& ctx, Tensor& dy, MoeBlockActs& a, RouterStats& stats) {
  if (!a.mlp.h.defined() && !a.moe.h.defined()) {
    // `full` saved the input only: the forward runs again, its router statistics counted once
    // (in the first forward).
    RouterStats again;
    run_forward(ctx, ops::to_f32(a.attn.x), a, ActivationCheckpoint::Mode::none, false, again);
  }
  if (sparse_)
    moe(ctx).backward(unit_, dy, a.moe, stats);
  else
    mlp(ctx).backward(unit_, dy, a.mlp);
  attention(ctx).backward(unit_, ctx, dy, a.attn);
  a = MoeBlockActs();
}

}  // namespace loom
