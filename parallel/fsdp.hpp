#pragma once
// FSDP (ZeRO-3) and HSDP over the model's parameter units (docs/design.md decision 3), as UnitHooks
// that Model::forward and Model::backward call around each unit (model/model.hpp).
//
// Every unit is sharded over the `shard` group (the mesh's "dp_shard"). Around a unit's work:
//   before_forward(i)   gather unit i (all-gather of its shard, cast to the param dtype first;
//                       bf16 units also sum a small f32 side buffer of their norm weights), wait;
//                       then issue the all-gather of unit i + 1 (prefetch)
//   after_forward(i)    release unit i's full weights per the reshard policy
//   before_backward(i)  gather again if released; materialize the full f32 gradient; prefetch
//                       unit i - 1
//   after_backward(i)   reduce-scatter the full gradient (f32 or bf16 per reduce_dtype) into a
//                       shard-sized buffer, release the full weights and gradient; when the
//                       reduce-scatter completes its result is added to the gradient shard (so
//                       micro-batches accumulate)
// Pending collectives are driven with Work::test() in every hook (Open MPI progresses nonblocking
// collectives only inside MPI calls) and completed at the first hook after an op has run since
// their issue, waiting there if need be, never earlier: when buffers are freed, and so the peak, is
// a function of the layout, not of MPI's timing. Gradients are summed, not averaged: the trainer
// scales each micro-batch's loss by 1 / (global samples x seq_len), so the sum over ranks is the
// gradient of the step's mean loss, as in one process (docs/design.md decision 11).
//
// Reshard policy (what after_forward frees): `always` every unit, `default` all but the last
// block, `never` none. The head unit is never freed between its forward and backward (they are
// one fused computation, so freeing would only force a second gather), nor, with tied
// embeddings, the embedding (the head reads it).
//
// HSDP: with a `replicate` group of size > 1 (the mesh's "dp_replicate"), finish_step()
// all-reduces (sums) each gradient shard over it, once per step.
//
// Under pp (parallel/pipeline_fsdp.hpp) the pipeline decides what the hooks release and when a
// unit's gradient is complete, since its actions interleave micro-batches and split backwards
// (I/W): set_pipeline_mode(keep_gathered, defer_reduce), mark_reduce / reduce_marked,
// complete_pending, release_all_weights and the prefetch range.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/process_group.hpp"
#include "model/model.hpp"

namespace loom::parallel {

enum class ReshardPolicy { by_default, always, never };
ReshardPolicy reshard_policy_from_name(const std::string& name);  // default | always | never

struct FsdpConfig {
  ReshardPolicy reshard = ReshardPolicy::by_default;
  DType reduce_dtype = DType::f32;  // f32 or bf16
};

class Fsdp final : public UnitHooks {
 public:
  // The model must be sharded over `shard` (ShardLayout{shard.rank(), shard.size()}), but the
  // units Model::expert_unit names, which are sharded over `expert_shard` (expert parallelism: the
  // ranks of `shard` that hold the same experts; of size 1 they are whole on each rank and their
  // gradients complete without a reduce-scatter).
  Fsdp(Model& model, dist::ProcessGroup& shard, dist::ProcessGroup* replicate,
       const FsdpConfig& config, dist::ProcessGroup* expert_shard = nullptr);
  ~Fsdp() override;
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;

  void before_forward(size_t unit) override;
  void after_forward(size_t unit) override;
  void before_backward(size_t unit) override;
  void after_backward(size_t unit) override;

  // After each micro-batch's forward_backward: completes every pending collective; every unit is
  // released afterwards.
  void finish_backward();
  // After the last micro-batch of a step, before clipping: the HSDP all-reduce.
  void finish_step();

  // --- Under pp (parallel/pipeline_fsdp.hpp) ---
  // keep_gathered: the hooks never release a unit's full weights (pp_fsdp_gather = "step": each
  // unit is gathered once per step; finish_backward releases them at its end). defer_reduce:
  // after_backward neither reduce-scatters nor frees a unit's full gradient unless the unit is
  // marked (a zero-bubble W still adds to it; in step mode later micro-batches do).
  void set_pipeline_mode(bool keep_gathered, bool defer_reduce);
  bool keeps_gathered() const { return keep_gathered_; }
  // The unit's gradient is complete after the current action: its after_backward (or
  // reduce_marked, for a W action or the tied embedding, whose hooks do not run) reduces it.
  void mark_reduce(size_t unit);
  // Issues the reduce-scatter of every marked unit (complete_pending waits for it).
  void reduce_marked();
  // Completes every gather and reduce-scatter in flight; releases nothing.
  void complete_pending();
  // Releases every unit's full weights (full gradients still awaiting their reduction stay).
  void release_all_weights();
  // Prefetch only inside units [first, last) (a pipeline action's stage): a gather of another
  // stage's unit would be released, unused, after the action.
  void set_prefetch_range(size_t first, size_t last) {
    prefetch_first_ = first;
    prefetch_last_ = last;
  }

  dist::ProcessGroup& shard_group() { return shard_; }
  // The group unit i is sharded over.
  dist::ProcessGroup& group(size_t unit) { return *groups_[unit]; }
  // Whether after_forward(unit) releases the unit's full weights (so backward gathers it again).
  bool reshard_after_forward(size_t unit) const;

 private:
  struct UnitState;
  void progress();
  void issue_gather(size_t unit);
  void wait_gather(size_t unit);
  void complete_gather(size_t unit);
  void complete_reduce(size_t unit);
  void reduce(size_t unit);

  Model& model_;
  std::vector<ParamUnit*> units_;
  dist::ProcessGroup& shard_;
  std::vector<dist::ProcessGroup*> groups_;  // per unit: shard_ or the experts'
  dist::ProcessGroup* replicate_;
  FsdpConfig config_;
  bool tied_;
  std::vector<UnitState> state_;
  bool keep_gathered_ = false, defer_reduce_ = false;
  std::vector<bool> marked_;
  size_t prefetch_first_ = 0, prefetch_last_ = 0;  // set to every unit by the constructor
};

// The full f32 flat buffer [P] of a unit from every rank's [S] shard (an all-gather over the
// group the unit is sharded over; every rank gets it). For checkpoints.
Tensor gather_full(dist::ProcessGroup& group, const Tensor& shard);

}  // namespace loom::parallel
