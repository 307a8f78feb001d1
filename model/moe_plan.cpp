#include "model/moe_plan.hpp"

namespace loom {

namespace {

constexpr PlanEntry kMoePlan[] = {
    {"model.embed_tokens.weight", TpStyle::column},  // vocabulary-parallel rows
    {"model.layers.*.input_layernorm.weight", TpStyle::replicated},
    {"model.layers.*.self_attn.q_proj.weight", TpStyle::column},
    {"model.layers.*.self_attn.k_proj.weight", TpStyle::column},
    {"model.layers.*.self_attn.v_proj.weight", TpStyle::column},
    {"model.layers.*.self_attn.o_proj.weight", TpStyle::row},
    {"model.layers.*.self_attn.q_proj.bias", TpStyle::column},  // Qwen2-MoE's
    {"model.layers.*.self_attn.k_proj.bias", TpStyle::column},
    {"model.layers.*.self_attn.v_proj.bias", TpStyle::column},
    {"model.layers.*.self_attn.q_norm.weight", TpStyle::replicated},
    {"model.layers.*.self_attn.k_norm.weight", TpStyle::replicated},
    {"model.layers.*.post_attention_layernorm.weight", TpStyle::replicated},
    // Qwen3-MoE's dense layers (mlp_only_layers).
    {"model.layers.*.mlp.gate_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.up_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.down_proj.weight", TpStyle::row},
    {"model.layers.*.mlp.gate.weight", TpStyle::replicated},
    {"model.layers.*.mlp.gate.e_score_correction_bias", TpStyle::replicated},  // loom_expert_bias
    {"model.layers.*.mlp.experts.*.gate_proj.weight", TpStyle::experts},
    {"model.layers.*.mlp.experts.*.up_proj.weight", TpStyle::experts},
    {"model.layers.*.mlp.experts.*.down_proj.weight", TpStyle::experts},
    // Qwen2-MoE's shared expert: a dense MLP on every token, split as Llama's.
    {"model.layers.*.mlp.shared_expert.gate_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.shared_expert.up_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.shared_expert.down_proj.weight", TpStyle::row},
    {"model.layers.*.mlp.shared_expert_gate.weight", TpStyle::replicated},
    {"model.layers.*.block_sparse_moe.gate.weight", TpStyle::replicated},
    {"model.layers.*.block_sparse_moe.gate.e_score_correction_bias", TpStyle::replicated},
    {"model.layers.*.block_sparse_moe.experts.*.w1.weight", TpStyle::experts},
    {"model.layers.*.block_sparse_moe.experts.*.w2.weight", TpStyle::experts},
    {"model.layers.*.block_sparse_moe.experts.*.w3.weight", TpStyle::experts},
    {"model.norm.weight", TpStyle::replicated},
    {"lm_head.weight", TpStyle::column},  // vocabulary-parallel rows (loss parallel)
};

}  // namespace

std::span<const PlanEntry> moe_plan() {
  return kMoePlan;
}

}  // namespace loom
