#pragma once
// The mixture-of-experts families' tensor-parallel plan: the attention, embedding and head as
// Llama's (model/llama_plan.hpp), the router, the experts and the q/k norms replicated (expert
// parallelism, not tensor parallelism, splits the experts: docs/decisions/moe.md). Both families'
// names (Qwen3-MoE's mlp.*, Mixtral's block_sparse_moe.*).
#include <span>

#include "model/tp_plan.hpp"

namespace loom {

std::span<const PlanEntry> moe_plan();

}  // namespace loom
