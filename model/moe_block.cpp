#include "model/moe_block.hpp"

#include <cmath>
#include <string>

#include "core/error.hpp"
#include "model/moe_capacity.hpp"
#include "model/moe_plan.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

// Each parameter split as the plan says, `specs` holding the whole tensors' shapes: this tp rank's
// rows (column-parallel) or columns (row-parallel); the experts are whole (the caller builds this
// rank's).
std::vector<ParamSpec> with_plan(std::vector<ParamSpec> specs, const TpRuntime& tp) {
  const int n = tp.on() ? tp.opt.size() : 1;
  for (ParamSpec& s : specs) {
    s.split = split_of(moe_plan(), s.name);
    s.tp_rank = tp.on() ? tp.opt.rank() : 0;
    s.tp_count = n;
    if (s.split == TpSplit::rows) s.shape[0] /= n;
    if (s.split == TpSplit::cols) s.shape[1] /= n;
  }
  return specs;
}

std::string layer_prefix(int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".";
}

// Output projections of the residual branches start smaller (GPT-2 / Megatron scaled init).
float out_std(const MoeConfig& c) {
  return 0.02f / std::sqrt(2.0f * float(c.base.num_hidden_layers));
}

ParamSpec norm_spec(std::string name, int64_t n) {
  return ParamSpec{std::move(name), {n}, Init::ones, 0, false, true};
}

ParamSpec gemm_spec(std::string name, int64_t rows, int64_t cols, float std) {
  ParamSpec s{std::move(name), {rows, cols}, Init::normal, std, true, false};
  s.gemm_grad = true;
  return s;
}

// The attention block's parameters, in the unit's order: the attention's, post_attention_layernorm,
// then the dense MLP's or the router.
std::vector<ParamSpec> attention_specs(const MoeConfig& c, int64_t layer, bool sparse,
                                       const TpRuntime& tp) {
  const std::string p = layer_prefix(layer);
  const LlamaConfig& b = c.base;
  const int64_t d = b.hidden_size, hd = c.head_dim;
  const int64_t q = b.num_attention_heads * hd, kv = b.num_key_value_heads * hd;
  std::vector<ParamSpec> specs{norm_spec(p + "input_layernorm.weight", d),
                               gemm_spec(p + "self_attn.q_proj.weight", q, d, 0.02f),
                               gemm_spec(p + "self_attn.k_proj.weight", kv, d, 0.02f),
                               gemm_spec(p + "self_attn.v_proj.weight", kv, d, 0.02f),
                               gemm_spec(p + "self_attn.o_proj.weight", d, q, out_std(c))};
  if (c.qk_norm()) {
    specs.push_back(norm_spec(p + "self_attn.q_norm.weight", hd));
    specs.push_back(norm_spec(p + "self_attn.k_norm.weight", hd));
  }
  if (c.qkv_bias())  // zeros at first, as transformers initializes a Linear's bias
    for (auto [n, rows] : {std::pair{"q", q}, std::pair{"k", kv}, std::pair{"v", kv}})
      specs.push_back(
          ParamSpec{p + "self_attn." + n + "_proj.bias", {rows}, Init::normal, 0.0f, false, true});
  specs.push_back(norm_spec(p + "post_attention_layernorm.weight", d));
  if (!sparse) {
    const int64_t F = b.intermediate_size;
    specs.push_back(gemm_spec(p + "mlp.gate_proj.weight", F, d, 0.02f));
    specs.push_back(gemm_spec(p + "mlp.up_proj.weight", F, d, 0.02f));
    specs.push_back(gemm_spec(p + "mlp.down_proj.weight", d, F, out_std(c)));
  } else {
    const std::string m = p + c.moe_prefix();
    specs.push_back(gemm_spec(m + "gate.weight", c.num_experts, d, 0.02f));
    if (const int64_t Fs = c.shared_expert_intermediate_size) {
      // Qwen2-MoE's shared expert (gate and up adjacent: one fused matrix) and its gate.
      specs.push_back(gemm_spec(m + "shared_expert.gate_proj.weight", Fs, d, 0.02f));
      specs.push_back(gemm_spec(m + "shared_expert.up_proj.weight", Fs, d, 0.02f));
      specs.push_back(gemm_spec(m + "shared_expert.down_proj.weight", d, Fs, out_std(c)));
      specs.push_back(gemm_spec(m + "shared_expert_gate.weight", 1, d, 0.02f));
    }
    // Last, so that no other index moves: the selection-only bias, zeros at first (no gradient
    // and no weight decay, so AdamW leaves it as it is; the model steps it, model/moe_balance.hpp).
    if (c.expert_bias)
      specs.push_back(ParamSpec{
          m + "gate.e_score_correction_bias", {c.num_experts}, Init::normal, 0.0f, false, true});
  }
  return with_plan(std::move(specs), tp);
}

// The experts' parameters: expert by expert its gate and up (adjacent: one fused GEMM matrix),
// then every expert's down. An expert that gets no token writes no gradient: the experts'
// gradients are zeroed each step and their GEMMs add (ParamSpec::gemm_grad false).
// Experts [first, first + count) (their global indices in the names).
std::vector<ParamSpec> expert_specs(const MoeConfig& c, int64_t layer, int64_t first, int64_t count,
                                    const TpRuntime& tp) {
  using M = MoeConfig::ExpertMatrix;
  const int64_t d = c.base.hidden_size, F = c.moe_intermediate_size;
  auto expert = [&](int64_t e, M m, int64_t rows, int64_t cols, float std) {
    ParamSpec s = gemm_spec(c.expert_param(layer, e, m), rows, cols, std);
    s.gemm_grad = false;
    return s;
  };
  std::vector<ParamSpec> specs;
  for (int64_t e = first; e < first + count; ++e) {
    specs.push_back(expert(e, M::gate, F, d, 0.02f));
    specs.push_back(expert(e, M::up, F, d, 0.02f));
  }
  for (int64_t e = first; e < first + count; ++e)
    specs.push_back(expert(e, M::down, d, F, out_std(c)));
  return with_plan(std::move(specs), tp);
}

}  // namespace

int tp_size(const ParallelContext& par) {
  return par.tp.on() ? par.tp.opt.size() : 1;
}

int64_t local_experts(const MoeConfig& c, const ParallelContext& par) {
  return c.num_experts / par.ep.size() / tp_size(par);
}

int64_t first_expert(const MoeConfig& c, const ParallelContext& par) {
  const int64_t block = c.num_experts / par.ep.size();
  return par.ep.rank() * block + (par.tp.on() ? par.tp.opt.rank() : 0) * local_experts(c, par);
}

MoeAttentionBlock::MoeAttentionBlock(const MoeConfig& c, int64_t layer, bool bf16, Device device,
                                     ShardLayout shard, const ParallelContext* par)
    : c_(c),
      par_(par ? par : &no_parallelism()),
      sparse_(c.sparse(layer)),
      norm2_(5 + (c.qk_norm() ? 2 : 0) + (c.qkv_bias() ? 3 : 0)),
      unit_("layers." + std::to_string(layer), attention_specs(c, layer, sparse_, par_->tp), bf16,
            device, shard) {}

Attention MoeAttentionBlock::attention(const StepContext& ctx) const {
  return Attention::of(*par_, ctx, 0, 1, 4, c_.qk_norm() ? 5 : Attention::kNone,
                       c_.qkv_bias() ? 5 + (c_.qk_norm() ? 2 : 0) : Attention::kNone,
                       c_.base.hidden_size, c_.head_dim, c_.base.num_attention_heads,
                       c_.base.num_key_value_heads, float(c_.base.rms_norm_eps));
}

Mlp MoeAttentionBlock::mlp(const StepContext& ctx) const {
  const Attention at = attention(ctx);
  return {par_->tp,   norm2_,      norm2_ + 1,
          norm2_ + 3, kPrecision,  at.M,
          at.Mx,      at.d,        c_.base.intermediate_size / tp_size(*par_),
          at.eps,     ctx.compute, at.keep_gathered};
}

MoeRouter MoeAttentionBlock::router(const StepContext& ctx) const {
  const Attention at = attention(ctx);
  return {.tp = par_->tp,
          .norm = norm2_,
          .router = norm2_ + 1,
          .shared = c_.shared_expert_intermediate_size > 0 ? norm2_ + 2 : MoeRouter::kNone,
          .shared_ffn = c_.shared_expert_intermediate_size / tp_size(*par_),
          .M = at.M,
          .Mx = at.Mx,
          .d = c_.base.hidden_size,
          .E = c_.num_experts,
          .k = c_.num_experts_per_tok,
          .ep = par_->ep.size(),
          .renormalize = c_.norm_topk_prob,
          .capacity = expert_capacity(c_.training.capacity_factor, ctx.tokens() * par_->cp.size(),
                                      c_.num_experts_per_tok, c_.num_experts),
          .eps = float(c_.base.rms_norm_eps),
          .compute = ctx.compute,
          .bias = c_.expert_bias ? bias_param() : MoeRouter::kNone,
          .cp = par_->cp.group,
          .ctx = &ctx};
}

size_t MoeAttentionBlock::bias_param() const {
  LOOM_CHECK(sparse_ && c_.expert_bias, unit_.name(), ": no e_score_correction_bias");
  return norm2_ + 2 + (c_.shared_expert_intermediate_size > 0 ? 4 : 0);
}

Tensor MoeAttentionBlock::forward(const StepContext& ctx, const Tensor& x, MoeAttentionActs& a,
                                  RouterStats& stats) const {
  // In bf16 the residual stream enters each layer rounded to bf16 (as LlamaBlock::forward).
  const bool round = ctx.compute != DType::f32;
  a.attn.x = round ? Tensor::empty(x.shape(), ctx.compute, x.device()) : x;
  Tensor out = run_forward(ctx, x, a, ac_, true, &stats, round);
  if (ac_ == ActivationCheckpoint::Mode::full) {
    // The input stays, and a sparse layer's routing (the experts block reads it first).
    MoeAttentionActs kept;
    kept.attn.x = a.attn.x;
    kept.routing = std::move(a.routing);
    a = std::move(kept);
  }
  return out;
}

// With `stats` null (a recomputation) a sparse layer's routing is kept as it is.
Tensor MoeAttentionBlock::run_forward(const StepContext& ctx, const Tensor& x, MoeAttentionActs& a,
                                      ActivationCheckpoint::Mode mode, bool output,
                                      RouterStats* stats, bool round_input) const {
  Tensor h = attention(ctx).forward(unit_, ctx, x, a.attn, mode, round_input);
  if (!sparse_) {
    a.mlp.h = h;
    return mlp(ctx).forward(unit_, a.mlp, mode, output);
  }
  if (stats) {
    a.routing.h = h;
    router(ctx).forward(unit_, a.routing, *stats);
  }
  return h;
}

void MoeAttentionBlock::backward(const StepContext& ctx, Tensor& dy, MoeAttentionActs& a,
                                 const RouterStats& stats) {
  if (!a.attn.rstd1.defined()) {
    // `full` saved the input only: the attention (and a dense MLP) runs again.
    run_forward(ctx, ops::to_f32(a.attn.x), a, ActivationCheckpoint::Mode::none, false, nullptr);
  }
  if (sparse_)
    router(ctx).backward(unit_, dy, a.routing, stats);
  else
    mlp(ctx).backward(unit_, dy, a.mlp);
  attention(ctx).backward(unit_, ctx, dy, a.attn);
  a = MoeAttentionActs();
}

MoeExpertsBlock::MoeExpertsBlock(const MoeConfig& c, int64_t layer, bool bf16, Device device,
                                 ShardLayout shard, const ParallelContext* par)
    : c_(c),
      par_(par ? par : &no_parallelism()),
      unit_("layers." + std::to_string(layer) + ".experts",
            expert_specs(c, layer, first_expert(c, *par_), local_experts(c, *par_), par_->tp), bf16,
            device, par_->ep.group ? par_->ep.shard : shard) {}

MoeExperts MoeExpertsBlock::experts(const StepContext& ctx) const {
  const int64_t M = ctx.tokens();
  return {.ep = par_->ep.group,
          .tp = par_->tp,
          .M = M,
          .Mx = par_->tp.sp() ? M / tp_size(*par_) : M,
          .d = c_.base.hidden_size,
          .E = c_.num_experts,
          .k = c_.num_experts_per_tok,
          .F = c_.moe_intermediate_size,
          .compute = ctx.compute};
}

Tensor MoeExpertsBlock::forward(const StepContext& ctx, const MoeRouting& routing,
                                MoeExpertsActs& a) const {
  Tensor y = experts(ctx).forward(unit_, routing, a);
  if (ac_ == ActivationCheckpoint::Mode::full) a = MoeExpertsActs();
  return y;
}

void MoeExpertsBlock::backward(const StepContext& ctx, const Tensor& dy, MoeRouting& routing,
                               MoeExpertsActs& a) {
  if (!a.xs.defined()) experts(ctx).forward(unit_, routing, a, false);
  experts(ctx).backward(unit_, dy, routing, a);
}

}  // namespace loom
