#pragma once
// FSDP under pipeline parallelism: when a pp rank's units are gathered, released and
// reduce-scattered. A pp rank's actions interleave micro-batches of its stages, and zero-bubble
// schedules split a backward into I (input gradient, with the hooks) and W (the linear layers'
// weight gradients, without them), so FSDP's per-unit hooks alone cannot tell when a unit's
// gradient is complete. The plan below says it per action of the rank's list.
//
//   pp_fsdp_gather = "microbatch": every action gathers the units it runs and releases them after
//   it (every collective is completed after every action: left in flight across actions, pp2 x
//   fsdp2 with reshard "always" ended 4e-3 off one process in 2 runs of 3). A unit's gradient is
//   reduce-scattered after the action that completes it: its B, or, under zero bubble, the W
//   after which no I that wrote it awaits its W (W adds into the same full gradient as the I).
//   pp_fsdp_gather = "step": a unit is gathered at its first action of the step and kept until
//   the step's end; its gradient accumulates over every micro-batch of the step in the full
//   buffer and is reduce-scattered once, after the step's last action that writes it (in the
//   step's last run of the schedule). Gathers and reduce-scatters fall from one per action and
//   micro-batch to one per step; the full weights and gradients of the rank's units stay alive
//   for the whole step.
//
// The units whose gradient a stage writes: its own and, on the head's stage of a model with tied
// embeddings, the embedding (the head's projection reads and writes it: the last stage's replica
// when the first stage is on another rank, reduce-scattered like any unit before the tied sum).
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/fsdp.hpp"
#include "parallel/pipeline_executor.hpp"

namespace loom {

enum class PpFsdpGather { microbatch, step };
// The [parallelism] pp_fsdp_gather value; fails naming the key and the accepted values.
PpFsdpGather pp_fsdp_gather_from_name(const std::string& name);

// The units whose full gradient stage `stage` writes (ascending).
std::vector<size_t> pp_grad_units(const std::vector<pp::UnitRange>& stage_units, int stage,
                                  size_t num_units, bool tie_word_embeddings);

// Per action of `rank`'s list (same index): the units whose gradient is complete after it and is
// reduce-scattered then (step mode: only in the step's last run of the schedule).
std::vector<std::vector<size_t>> pp_fsdp_reduce_plan(const pp::Schedule& schedule,
                                                     const std::vector<pp::UnitRange>& stage_units,
                                                     int rank, size_t num_units,
                                                     bool tie_word_embeddings, PpFsdpGather mode);

// The executor's hooks that drive `fsdp` by the plan (installed with PipelineExecutor::set_hooks;
// the executor owns them, and `fsdp` outlives it in ParallelModel).
class PipelineFsdp final : public PipelineHooks {
 public:
  PipelineFsdp(const PipelineExecutor& pipe, parallel::Fsdp& fsdp, size_t num_units,
               bool tie_word_embeddings, PpFsdpGather mode);
  // Marks the units the action completes (step mode: only in the last round), so that a B's own
  // units are reduce-scattered in their after_backward hooks, overlapping the backward of the
  // units before them; keeps the prefetch inside the action's stage.
  void before_action(const pp::Action& a, bool last_round) override;
  // The rest (a W's units, the tied embedding's replica, whose hooks did not run); then every
  // collective completes within the action (see the top of this file).
  void after_action(const pp::Action& a, bool last_round) override;

 private:
  const PipelineExecutor& pipe_;
  parallel::Fsdp& fsdp_;
  bool step_;
  // Per action with reductions, by (stage, op, micro-batch), unique in a rank's list.
  std::map<std::tuple<int, int, int>, std::vector<size_t>> due_;
};

}  // namespace loom
