#include "model/gla_plan.hpp"

namespace loom {

namespace {

constexpr PlanEntry kGlaPlan[] = {
    {"model.embeddings.weight", TpStyle::replicated},
    {"model.layers.*.attn_norm.weight", TpStyle::replicated},
    {"model.layers.*.attn.q_proj.weight", TpStyle::column},
    {"model.layers.*.attn.k_proj.weight", TpStyle::column},
    {"model.layers.*.attn.v_proj.weight", TpStyle::column},
    {"model.layers.*.attn.g_proj.weight", TpStyle::column},
    {"model.layers.*.attn.gk_proj.0.weight", TpStyle::replicated},
    {"model.layers.*.attn.gk_proj.1.weight", TpStyle::column},
    {"model.layers.*.attn.gk_proj.1.bias", TpStyle::column},
    {"model.layers.*.attn.g_norm_swish_gate.weight", TpStyle::replicated},
    {"model.layers.*.attn.g_norm.weight", TpStyle::replicated},
    {"model.layers.*.attn.o_proj.weight", TpStyle::row},
    {"model.layers.*.attn.q_conv1d.weight", TpStyle::column},
    {"model.layers.*.attn.k_conv1d.weight", TpStyle::column},
    {"model.layers.*.attn.v_conv1d.weight", TpStyle::column},
    {"model.layers.*.mlp_norm.weight", TpStyle::replicated},
    {"model.layers.*.mlp.gate_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.up_proj.weight", TpStyle::column},
    {"model.layers.*.mlp.down_proj.weight", TpStyle::row},
    {"model.norm.weight", TpStyle::replicated},
    {"lm_head.weight", TpStyle::replicated},
};

}  // namespace

std::span<const PlanEntry> gla_plan() {
  return kGlaPlan;
}

}  // namespace loom
