#pragma once
// Runs one pp rank's action list (parallel/pipeline/schedule.hpp) on the model: per micro-batch an
// ActivationStore lives from the rank's first forward of it to its last backward; a stage's
// forward and backward are Model::forward/backward over the stage's units; activations and
// their gradients cross ranks as tagged nonblocking sends/receives on the pp group (the tag is the
// message's direction, stage and micro-batch, so messages between the same two ranks cannot be
// matched to the wrong receive), each with the model's carry beside it where the model has one
// (a few numbers per micro-batch: Model::carry_buffer), receives posted one action ahead so that a
// transfer overlaps the compute before it, between two stages of one rank handed over without a
// message; a send's buffer is freed at a test fixed by the schedule (where its receiver has
// posted the receive in the schedule simulated with unit costs), so that the peak never depends on
// MPI's timing. Every wait has the group's deadline, and a timeout names the schedule, action,
// stage, micro-batch and peer. One run is a small state machine (PipelineExecutor::Round in the
// .cpp): a method per action kind, `run` the loop over the rank's list. Data parallelism's glue
// runs around every action as PipelineHooks (pipeline_fsdp.hpp, pipeline_ddp.hpp).
// The loss is computed where the head is; gradients accumulate in the units in micro-batch order
// per stage, the order of grad_accum_steps, so pp changes no bit of them.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "distributed/process_group.hpp"
#include "model/model.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/stage_split.hpp"

namespace loom {

// A micro-batch's tokens, borrowed: valid for the whole run.
struct MicroBatchView {
  const int32_t* inputs = nullptr;   // [B, T]
  const int32_t* targets = nullptr;  // [B, T]
  int64_t B = 0, T = 0;
};

// What data parallelism does around the pipeline's actions (parallel/pipeline_fsdp.hpp,
// parallel/pipeline_ddp.hpp): called before and after every action, `last_round` whether this run
// of the schedule is the step's last (where the gradients are reduced); false in validation.
class PipelineHooks {
 public:
  virtual ~PipelineHooks() = default;
  virtual void before_action(const pp::Action& a, bool last_round) = 0;
  virtual void after_action(const pp::Action& a, bool last_round) = 0;
  // After the step's last run, before the tied embedding's gradients are summed.
  virtual void finish_step() {}
};

// The units whose weights pp rank `rank` reads (ascending): its stages' and, when the model ties
// its embeddings and the first and last stages are on different ranks, the embedding's replica on
// the head's rank. A function of the schedule alone, so that the model can be built with the
// other units on Device::elsewhere before the executor exists.
std::vector<size_t> pp_used_units(const pp::Schedule& schedule,
                                  const std::vector<pp::UnitRange>& stage_units, int rank,
                                  bool tie_word_embeddings);

class PipelineExecutor {
 public:
  // `stage_units[s]`: the units of stage s (pp::stage_units). `group`: the pp group, whose rank
  // is the pp rank; nullptr for a one-rank schedule.
  PipelineExecutor(Model& model, pp::Schedule schedule, std::vector<pp::UnitRange> stage_units,
                   dist::ProcessGroup* group);

  const pp::Schedule& schedule() const { return schedule_; }
  int rank() const { return rank_; }
  // The units of this rank's stages, ascending.
  std::vector<size_t> owned_units() const;
  // The units whose weights this rank reads: its own and, on the head's rank of a model with
  // tied embeddings across ranks, the embedding's replica (a resume must load it too).
  std::vector<size_t> used_units() const;
  // Per unit (units() order): whether this rank's stages hold it, i.e. whether this rank counts
  // its gradient in the norm (a tied embedding's replica on the last stage is not counted).
  std::vector<bool> counted_units() const;
  bool holds_head() const;
  int unit_owner(size_t unit) const;  // the pp rank whose stage holds the unit

  // One run of the schedule: this rank's actions over micro-batches 0..microbatches-1
  // (`batch(j)`). Gradients of grad_scale x the summed loss accumulate into this rank's units.
  // Returns `loss` plus the losses of the micro-batches whose head is on this rank, added in
  // micro-batch order (`loss` elsewhere): a step of several rounds adds its losses as one
  // process's loop does. `last_round`: whether this run is the step's last (the hooks reduce
  // there).
  double run(const std::function<MicroBatchView(int)>& batch, float grad_scale, double loss = 0,
             bool last_round = true);

  // Forward only (validation): micro-batches 0..n-1 through every stage, the head's loss computed
  // with a zero gradient scale and nothing sent back. Each rank runs its (micro-batch, stage)
  // pairs in that order, which every dependency follows, so blocking receives cannot deadlock.
  // Returns the summed loss of the micro-batches on the head's rank (0 elsewhere), in micro-batch
  // order. The caller clears the (zero) gradients.
  double run_forward(const std::function<MicroBatchView(int)>& batch, int n);

  // Data parallelism's glue (FSDP or DDP), run around every action.
  void set_hooks(std::unique_ptr<PipelineHooks> hooks) { hooks_ = std::move(hooks); }
  const pp::UnitRange& stage_units(int stage) const { return units_[size_t(stage)]; }

  // After the step's last run (and before the norm): the hooks' finish_step, then the tied
  // embedding's gradients summed.
  void finish_step();
  // Tied embeddings with the first and last stages on different ranks: the last stage's head
  // writes its replica of the embedding. Called once per step after every round (and before the
  // norm): the first and last stages exchange the embedding's gradient and both keep the sum.
  bool tied_across_ranks() const { return tied_across_; }
  void sum_tied_gradients();
  // For the anti-test only: the tied gradients are not summed, which the parity must catch.
  void set_skip_tied_sum(bool on) { skip_tied_sum_ = on; }

  // For the anti-test only: W actions drop their deferred weight gradients instead of running
  // them, which the parity must catch.
  void set_drop_weight_grads(bool on) { drop_weight_grads_ = on; }

  // For the anti-test only: micro-batch j's activation is sent as j ^ 1's, so the next stage
  // computes on its neighbour's, which the parity test must catch.
  void set_swap_activations(bool on) { swap_activations_ = on; }

  // For the anti-test only: the model's carries beside the gradients (Model::carry_buffer) do not
  // travel, so a stage's backward misses what the head computed (a mixture of experts' auxiliary
  // loss gradient), which the comparison must catch. Every rank must set it alike. (Without the
  // forward carries a mixture of experts' head stops with an error: its step's expert loads lack
  // the other stages' layers.)
  void set_drop_backward_carries(bool on) { drop_backward_carries_ = on; }

 private:
  class Round;  // what one run holds between its actions (pipeline_executor.cpp)

  Model& model_;
  pp::Schedule schedule_;
  std::vector<pp::UnitRange> units_;
  dist::ProcessGroup* group_;
  int rank_ = 0;
  bool swap_activations_ = false;
  bool tied_across_ = false;
  bool skip_tied_sum_ = false;
  bool drop_weight_grads_ = false;
  bool drop_backward_carries_ = false;
  // Per message this rank sends, (backward, stage, micro-batch): the test after an action that
  // frees its buffer (pp::SimResult::send_tests; 0: the step's final wait).
  std::map<std::tuple<bool, int, int>, int> send_tests_;
  std::unique_ptr<PipelineHooks> hooks_;
};

}  // namespace loom
