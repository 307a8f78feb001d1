#pragma once
// A model's tensor-parallel plan as a table (flame's parallelize_fla, torchtitan's
// parallelize_plan): for each parameter name pattern, how tensor parallelism splits it. Each model
// owns its plan (model/llama_plan.hpp, model/gla_plan.hpp) and builds its parameters' local
// shards by it (split_of), so the plan is the place to read (and later to choose) the layout;
// parallelize() checks the built model against it (check_plan).
#include <span>
#include <string>

#include "model/param_unit.hpp"

namespace loom {

class Model;

enum class TpStyle {
  column,      // output rows split over tp (ParamSpec TpSplit::rows): q, k, v, gate, up, vocab
  row,         // input columns split over tp (TpSplit::cols): o, down; outputs summed over tp
  replicated,  // whole on every tp rank (TpSplit::none); with SP the gradient is summed over tp
  experts,     // a mixture of experts' experts divided over tp, each whole (TpSplit::experts)
};
const char* tp_style_name(TpStyle s);

struct PlanEntry {
  const char* pattern;  // a parameter name; `*` stands for one dot-free run (a layer index)
  TpStyle style;
};

// Whether `name` matches `pattern` (`*`: any run of characters other than '.').
bool plan_matches(const std::string& pattern, const std::string& name);

// The style of parameter `name` in `plan` (its first matching entry); loom::Error naming the
// parameter when it has none.
TpStyle style_of(std::span<const PlanEntry> plan, const std::string& name);
// How that style splits the parameter's tensor.
TpSplit split_of(std::span<const PlanEntry> plan, const std::string& name);

// loom::Error naming the parameter when one of the model's parameters has no entry in `plan`, or
// is split otherwise than the plan says.
void check_plan(Model& model, std::span<const PlanEntry> plan);

}  // namespace loom
