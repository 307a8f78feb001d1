#include "parallel/llama_plan.hpp"

#include "core/error.hpp"
#include "model/model.hpp"

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

TpStyle style_of(TpSplit s) {
  switch (s) {
    case TpSplit::rows:
      return TpStyle::column;
    case TpSplit::cols:
      return TpStyle::row;
    case TpSplit::none:
      break;
  }
  return TpStyle::replicated;
}

}  // namespace

const char* tp_style_name(TpStyle s) {
  switch (s) {
    case TpStyle::column:
      return "column-parallel";
    case TpStyle::row:
      return "row-parallel";
    case TpStyle::replicated:
      break;
  }
  return "replicated";
}

std::span<const PlanEntry> llama_plan() {
  return kLlamaPlan;
}

std::span<const PlanEntry> gla_plan() {
  return kGlaPlan;
}

bool plan_matches(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0;
  while (p < pattern.size()) {
    if (pattern[p] == '*') {
      const size_t start = n;
      while (n < name.size() && name[n] != '.') ++n;
      if (n == start) return false;
      ++p;
    } else {
      if (n >= name.size() || name[n] != pattern[p]) return false;
      ++p;
      ++n;
    }
  }
  return n == name.size();
}

void check_plan(Model& model, std::span<const PlanEntry> plan) {
  for (ParamUnit* u : model.units())
    for (const Param& p : u->params()) {
      const PlanEntry* entry = nullptr;
      for (const PlanEntry& e : plan)
        if (plan_matches(e.pattern, p.spec.name)) {
          entry = &e;
          break;
        }
      LOOM_CHECK(entry, "tensor parallel plan: the model's parameter ", p.spec.name,
                 " has no entry in the plan");
      const TpStyle has = style_of(p.spec.split);
      LOOM_CHECK(has == entry->style, "tensor parallel plan: the model's parameter ", p.spec.name,
                 " is ", tp_style_name(has), " but the plan's entry ", entry->pattern, " says ",
                 tp_style_name(entry->style));
    }
}

}  // namespace loom
