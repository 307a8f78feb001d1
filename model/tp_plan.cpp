#include "model/tp_plan.hpp"

#include "core/error.hpp"
#include "model/model.hpp"

namespace loom {

namespace {

TpStyle style_of_split(TpSplit s) {
  switch (s) {
    case TpSplit::rows:
      return TpStyle::column;
    case TpSplit::cols:
      return TpStyle::row;
    case TpSplit::experts:
      return TpStyle::experts;
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
    case TpStyle::experts:
      return "experts divided over tp";
    case TpStyle::replicated:
      break;
  }
  return "replicated";
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

namespace {

const PlanEntry& entry_of(std::span<const PlanEntry> plan, const std::string& name) {
  for (const PlanEntry& e : plan)
    if (plan_matches(e.pattern, name)) return e;
  fail("tensor parallel plan: the model's parameter ", name, " has no entry in the plan");
}

}  // namespace

TpStyle style_of(std::span<const PlanEntry> plan, const std::string& name) {
  return entry_of(plan, name).style;
}

TpSplit split_of(std::span<const PlanEntry> plan, const std::string& name) {
  switch (style_of(plan, name)) {
    case TpStyle::column:
      return TpSplit::rows;
    case TpStyle::row:
      return TpSplit::cols;
    case TpStyle::experts:
      return TpSplit::experts;
    case TpStyle::replicated:
      break;
  }
  return TpSplit::none;
}

void check_plan(Model& model, std::span<const PlanEntry> plan) {
  for (ParamUnit* u : model.units())
    for (const Param& p : u->params()) {
      const PlanEntry& entry = entry_of(plan, p.spec.name);
      const TpStyle has = style_of_split(p.spec.split);
      LOOM_CHECK(has == entry.style, "tensor parallel plan: the model's parameter ", p.spec.name,
                 " is ", tp_style_name(has), " but the plan's entry ", entry.pattern, " says ",
                 tp_style_name(entry.style));
    }
}

}  // namespace loom
