#pragma once
// A mixture of experts' routing in the plan (docs/decisions/moe.md, its planning).
// The meta run routes nothing: each ep rank's experts get the balanced 1/ep of every rank's rows
// (load 1), unless PlanJob::ep_load says otherwise. Dropless, nothing bounds a real run's load
// but the routing itself: each token's k choices are k distinct experts, so one rank's E / ep
// experts get at most min(k, E / ep) of them, from every rank's tokens. That rank receives,
// regroups and computes ep x min(k, E / ep) / k times the balanced rows: its all-to-all
// receive buffers, grouped-GEMM inputs and outputs and saved activations grow by as much.
#include <optional>
#include <vector>

#include "plan/hardware.hpp"
#include "train/rank_plan.hpp"

namespace loom::plan {

// The most load one rank's experts can get (1 without experts or ep).
double worst_ep_load(const PlanJob& j);

struct EpWorstCase {
  double load = 1;                // worst_ep_load
  size_t peak = 0, reserved = 0;  // of the planned ranks, each planned as the most loaded one
  bool fits = false;
};

// The job planned at its worst load (not timed; planning stops at the first rank that does not
// fit, as the search's); nullopt without experts or ep.
std::optional<EpWorstCase> ep_worst_case(const PlanJob& j, const std::vector<int>& ranks,
                                         const Hardware& hw, bool oversubscribed);

}  // namespace loom::plan
