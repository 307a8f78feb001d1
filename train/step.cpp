#include "train/step.hpp"

#include <cmath>

#include "distributed/group_sum.hpp"

namespace loom {

TrainStep::TrainStep(ParallelModel& model, AdamW& optimizer, double max_norm,
                     int64_t tokens_per_step)
    : model_(model),
      optimizer_(optimizer),
      max_norm_(max_norm),
      tokens_per_step_(tokens_per_step) {}

StepResult TrainStep::run(int64_t micro_batches,
                          const std::function<const MicroBatch&(int64_t)>& batch, double lr) {
  const float grad_scale = float(1.0 / double(tokens_per_step_));
  model_.model->zero_grad();
  double loss_sum = 0;
  for (int64_t m = 0; m < micro_batches; ++m) {
    const MicroBatch& mb = batch(m);
    loss_sum += model_.forward_backward(mb.inputs.data(), mb.targets.data(), mb.B, mb.T, grad_scale,
                                        m + 1 == micro_batches);
  }
  model_.finish_step();
  StepResult r;
  r.loss = group_sum(model_.groups.dp, loss_sum) / double(tokens_per_step_);
  r.grad_norm =
      clip_grad_norm(model_.model->units(), max_norm_, model_.groups.shard, model_.groups.tp);
  r.updated = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  if (r.updated) optimizer_.step(float(lr));
  return r;
}

}  // namespace loom
