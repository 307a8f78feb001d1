#pragma once
// Llama's tensor-parallel plan (Megatron's layout), the source of the splits of LlamaModel's
// parameters: q, k, v, gate and up column-parallel, o and down row-parallel, the norms
// replicated; the embedding and the output head vocabulary-parallel (their rows split, the loss
// parallel).
#include <span>

#include "model/tp_plan.hpp"

namespace loom {

std::span<const PlanEntry> llama_plan();

}  // namespace loom
