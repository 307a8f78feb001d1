#include "model/llama_plan.hpp"

namespace loom {

namespace {

constexpr PlanEntry kLlamaPlan[] = {
    {"model.embed_tokens.weight", TpStyle::column},  // vocabulary-parallel rows
    {"model.layers.*.input_layernorm.weight", TpStyle::replicated},
    {"model.layers.*.self_attn.q_proj.weight", TpStyle::column},
    {"model.layers.*.self_attn.k_proj.weight", TpStyle::column},
    {"model.layers.*.self_attn.v_proj.weight", TpStyle::column},
    {"model.layers.*.self_attn.o_proj.weight", TpStyle::row},
    {"model.layers.*.post_attention_layernorm.weight", TpStyle::replicated},
    {"model.layers.*.mlp.gate_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.up_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.down_proj.weight", TpStyle::row},
    {"model.norm.weight", TpStyle::replicated},
    {"lm_head.weight", TpStyle::column},  // vocabulary-parallel rows (loss parallel)
};

}  // namespace

std::span<const PlanEntry> llama_plan() {
  return kLlamaPlan;
}

}  // namespace loom
