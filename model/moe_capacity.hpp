#pragma once
// The experts' capacity (the job's moe.capacity_factor; docs/decisions/moe.md): with a factor
// f > 0 each expert of a sparse layer computes at most C = ceil(tokens x k / E x f) of a
// micro-batch's choices, the first in token order (the micro-batch's B x T tokens, sample by
// sample); the rest are dropped (their weight's share of the output is lost, the residual
// passes). f = 0 is dropless. The micro-batch is the unit of the rule, as one process sees it,
// whatever the layout: under context parallelism a cp rank holds two chunks of every sample, so
// what it may keep of each expert depends on the other cp ranks' choices (cp_capacities).
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/process_group.hpp"
#include "model/step_context.hpp"

namespace loom {

// C for a micro-batch of `tokens` tokens (Megatron's get_capacity on tokens x k choices:
// ceil((tokens x k / E) x factor), in double); 0 (dropless) when factor is 0.
int64_t expert_capacity(double factor, int64_t tokens, int64_t k, int64_t E);

// Under context parallelism (ctx.cp_pos: every cp rank's global positions), the rows of each
// expert this rank keeps so that the micro-batch drops exactly what one process would: each cp
// rank's choice counts per run of consecutive positions of each sample are summed over `cp` (one
// all-gather of B x runs x E x cp doubles), then walked in token order against `capacity`. A
// rank's runs ascend, so what it keeps of an expert is the first rows of its own, in its token
// order: moe_permute's per-expert capacity. `experts` [B*T, k] (this rank's choices); on meta
// (no indices) the same collective runs and each expert gets ceil(capacity / cp).
std::vector<int64_t> cp_capacities(dist::ProcessGroup& cp, const StepContext& ctx,
                                   const Tensor& experts, int64_t E, int64_t capacity);

}  // namespace loom
