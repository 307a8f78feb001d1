#include "train/step.hpp"

#include <cmath>

#include "core/error.hpp"
#include "distributed/group_sum.hpp"

namespace loom {

TrainStep::TrainStep(ParallelModel& model, AdamW& optimizer, double max_norm,
                     int64_t tokens_per_step)
    : model_(model),
      optimizer_(optimizer),
      max_norm_(max_norm),
      tokens_per_step_(tokens_per_step) {}

StepResult TrainStep::run(int64_t micro_batches,
                          const std::function<const MicroBatch&(int64_t)>& batch, double lr,
                          const std::function<void()>& before_update) {
  const float grad_scale = float(1.0 / double(tokens_per_step_));
  model_.model->zero_grad();
  double loss_sum = 0;
  if (model_.pipeline) {
    loss_sum = run_pipeline(micro_batches, batch, grad_scale);
  } else {
    for (int64_t m = 0; m < micro_batches; ++m) {
      const MicroBatch& mb = batch(m);
      loss_sum += model_.forward_backward(mb.inputs.data(), mb.targets.data(), mb.B, mb.T,
                                          grad_scale, m + 1 == micro_batches);
    }
  }
  model_.finish_step();
  model_.model->check_grads_written();
  if (model_.pipeline && model_.pipeline->tied_across_ranks()) {
    // DDP reduced the first stage's embedding in its hooks; the last stage's replica never ran
    // them: its dp ranks (all on the last stage) sum it here, so the tied sum adds two dp sums.
    if (model_.ddp && model_.pipeline->holds_head())
      model_.groups.dp->all_reduce(model_.model->units().front()->grad_flat(), dist::ReduceOp::sum)
          ->wait();
    model_.pipeline->sum_tied_gradients();
  }
  StepResult r;
  // With pp the loss is on the head's rank only (0 elsewhere).
  r.loss =
      group_sum(model_.groups.pp, group_sum(model_.groups.dp, loss_sum)) / double(tokens_per_step_);
  r.grad_norm =
      grad_norm(model_.model->units(), model_.groups.shard, model_.groups.tp, model_.groups.pp,
                model_.pipeline ? model_.pipeline->counted_units() : std::vector<bool>{});
  r.updated = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  if (r.updated) {
    if (before_update) before_update();
    // Clipping scales the gradients as AdamW reads them (the same products as scaling them in
    // place first, one pass over them fewer).
    optimizer_.step(float(lr), clip_grad_scale(r.grad_norm, max_norm_));
  }
  return r;
}

namespace {

// The tokens of micro-batch `mb` this rank runs: its zigzag chunks under cp, all of them without.
CpBatch rank_tokens(const MicroBatch& mb, dist::ProcessGroup* cp, int sp_tp) {
  if (cp)
    return cp_local_batch(mb.inputs.data(), mb.targets.data(), mb.B, mb.T, cp->size(), cp->rank(),
                          sp_tp);
  CpBatch c;
  c.T = mb.T;
  c.inputs = mb.inputs;
  c.targets = mb.targets;
  return c;
}

}  // namespace

double TrainStep::run_pipeline(int64_t micro_batches,
                               const std::function<const MicroBatch&(int64_t)>& batch,
                               float grad_scale) {
  PipelineExecutor& pipe = *model_.pipeline;
  const int m = pipe.schedule().microbatches;
  LOOM_CHECK(micro_batches % m == 0, "pipeline: ", micro_batches,
             " micro-batches in the step, not a multiple of the schedule's ", m,
             " (parallelism.pp_microbatches)");
  double loss = 0;
  // The schedule touches its micro-batches in any order, and a store keeps pointers to its
  // tokens: each round's micro-batches are copied first (batch() is valid until its next call).
  // With cp each rank keeps its zigzag tokens of every sample (and sends its own rows).
  dist::ProcessGroup* cp = model_.groups.cp;
  const int sp_tp =
      model_.groups.tp && model_.model->tp().sequence_parallel ? model_.groups.tp->size() : 1;
  std::vector<CpBatch> round(static_cast<size_t>(m));
  for (int64_t first = 0; first < micro_batches; first += m) {
    int64_t B = 0;
    for (int j = 0; j < m; ++j) {
      const MicroBatch& mb = batch(first + j);
      B = mb.B;
      round[size_t(j)] = rank_tokens(mb, cp, sp_tp);
    }
    *model_.pp_last_round = first + m == micro_batches;
    loss = pipe.run(
        [&](int j) {
          const CpBatch& c = round[size_t(j)];
          return PipelineMicroBatch{c.inputs.data(), c.targets.data(), B, c.T};
        },
        grad_scale, loss);
  }
  return group_sum(cp, loss);
}

double pipeline_validation_loss(ParallelModel& model, const std::vector<MicroBatch>& batches) {
  dist::ProcessGroup* cp = model.groups.cp;
  const int sp_tp =
      model.groups.tp && model.model->tp().sequence_parallel ? model.groups.tp->size() : 1;
  std::vector<CpBatch> mine(batches.size());
  for (size_t j = 0; j < batches.size(); ++j) {
    mine[j] = rank_tokens(batches[j], cp, sp_tp);
  }
  const double loss = model.pipeline->run_forward(
      [&](int j) {
        const CpBatch& c = mine[size_t(j)];
        return PipelineMicroBatch{c.inputs.data(), c.targets.data(), batches[size_t(j)].B, c.T};
      },
      int(batches.size()));
  // FSDP's collectives completed after every action; its units are released here (kept gathered
  // under pp_fsdp_gather = "step", and the head's zero gradient is never reduced). DDP did not
  // sync (no backward action).
  if (model.fsdp) model.fsdp->finish_backward();
  model.model->zero_grad();
  // The loss is on the head's rank only: summed over pp (exact zeros elsewhere) it keeps its bits.
  return group_sum(model.groups.pp, group_sum(cp, loss));
}

}  // namespace loom
