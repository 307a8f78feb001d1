#pragma once
// A model's tensor-parallel plan as a table (flame's parallelize_fla, torchtitan's
// parallelize_plan): for each parameter name pattern, how tensor parallelism splits it. The
// model builds its local shards itself (ParamSpec::split); parallelize() checks that the model
// agrees with the plan, so the plan is the place to read (and later to choose) the layout.
#include <span>
#include <string>

namespace loom {

class Model;

enum class TpStyle {
  column,      // output rows split over tp (ParamSpec TpSplit::rows): q, k, v, gate, up, vocab
  row,         // input columns split over tp (TpSplit::cols): o, down; outputs summed over tp
  replicated,  // whole on every tp rank (TpSplit::none); with SP the gradient is summed over tp
};
const char* tp_style_name(TpStyle s);

struct PlanEntry {
  const char* pattern;  // a parameter name; `*` stands for one dot-free run (a layer index)
  TpStyle style;
};

// Llama's plan (Megatron's layout).
std::span<const PlanEntry> llama_plan();
// GLA's plan (flame's parallelize_fla): q, k, v, g and gk_proj.1 column-parallel, o row-parallel,
// gk_proj.0 and the norms replicated; the embedding and the head replicated (not vocabulary
// parallel).
std::span<const PlanEntry> gla_plan();

// Whether `name` matches `pattern` (`*`: any run of characters other than '.').
bool plan_matches(const std::string& pattern, const std::string& name);

// loom::Error naming the parameter when one of the model's parameters has no entry in `plan`, or
// is split otherwise than the plan says.
void check_plan(Model& model, std::span<const PlanEntry> plan);

}  // namespace loom
