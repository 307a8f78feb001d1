#pragma once
// DDP under pipeline parallelism: each unit is all-reduced once per step, in the backward of the
// step's last micro-batch of its last run of the schedule. Under zero bubble a unit's gradient is
// complete only after its stage's last W (I runs the hooks, W adds the linear layers' weight
// gradients after them), so its units are all-reduced then, not in the hook of I. With tied
// embeddings across ranks the last stage's replica of the embedding runs no hooks: its dp ranks
// (all on the last stage) sum it at the step's end, so the tied sum adds two dp sums.
#include "distributed/process_group.hpp"
#include "model/model.hpp"
#include "parallel/ddp.hpp"
#include "parallel/pipeline_executor.hpp"

namespace loom {

// The executor's hooks that drive `ddp` (installed with PipelineExecutor::set_hooks; the executor
// owns them, and `ddp` and the model outlive it in ParallelModel).
class PipelineDdp final : public PipelineHooks {
 public:
  PipelineDdp(const PipelineExecutor& pipe, parallel::Ddp& ddp, Model& model,
              dist::ProcessGroup& dp);
  // Reduce in the hooks only in the last round's last micro-batch's B.
  void before_action(const pp::Action& a, bool last_round) override;
  // Zero bubble: the stage's units after the last round's last micro-batch's W.
  void after_action(const pp::Action& a, bool last_round) override;
  // The head's replica of a tied embedding, summed over dp.
  void finish_step() override;

 private:
  const PipelineExecutor& pipe_;
  parallel::Ddp& ddp_;
  Model& model_;
  dist::ProcessGroup& dp_;
  int last_mb_;
  bool zb_;
};

}  // namespace loom
