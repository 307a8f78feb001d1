#pragma once
// GLA's tensor-parallel plan (flame's parallelize_fla), the source of the splits of GlaModel's
// parameters: q, k, v, g, gk_proj.1 and the short convolutions column-parallel (whole heads per
// rank), o row-parallel, gk_proj.0 and the norms replicated; the embedding and the head
// replicated (not vocabulary parallel).
#include <span>

#include "model/tp_plan.hpp"

namespace loom {

std::span<const PlanEntry> gla_plan();

}  // namespace loom
