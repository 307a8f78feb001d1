#pragma once
// The mixture-of-experts families' tensor-parallel plan: the attention, embedding and head as
// Llama's (model/llama_plan.hpp), a shared expert as Llama's MLP, the router and the q/k norms
// replicated, the experts divided over tp whole (each tp rank computes its slice of them for
// every row of its tp group: docs/decisions/moe.md). Both families' names (Qwen3-MoE's mlp.*,
// Mixtral's block_sparse_moe.*).
#include <span>

#include "model/tp_plan.hpp"

namespace loom {

std::span<const PlanEntry> moe_plan();

}  // namespace loom
