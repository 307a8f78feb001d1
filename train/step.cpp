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
                          const std::function<const MicroBatch&(int64_t)>& batch, double lr,
                          const std::function<void()>& before_update) {
  const float grad_scale = float(1.0 / double(tokens_per_step_));
  model_.model->zero_grad();
  model_.model->take_step_metrics();  // what a validation pass measured is not the step's
  const double loss_sum = model_.forward_backward_step(
      micro_batches,
      [&](int64_t m) {
        const MicroBatch& mb = batch(m);
        return MicroBatchView{mb.inputs.data(), mb.targets.data(), mb.B, mb.T};
      },
      grad_scale);
  model_.finish_step();
  model_.model->check_grads_written();
  StepResult r;
  // With pp the loss is on the head's rank only (0 elsewhere).
  r.loss =
      group_sum(model_.groups.pp, group_sum(model_.groups.dp, loss_sum)) / double(tokens_per_step_);
  r.model_metrics = model_.model->take_step_metrics();
  if (!r.model_metrics.empty()) {
    // Every rank of a data-parallel group runs the same model: the same metrics, in order. With
    // pp they are on the head's rank (zeros elsewhere, Model::take_step_metrics): summed over pp,
    // every rank has its figures.
    std::vector<double> v;
    for (const ModelMetric& m : r.model_metrics) v.push_back(m.value);
    const double dp = double(model_.groups.dp ? model_.groups.dp->size() : 1);
    v = group_sum_each(model_.groups.pp, group_sum_each(model_.groups.dp, v));
    for (size_t i = 0; i < v.size(); ++i) r.model_metrics[i].value = v[i] / dp;
  }
  r.grad_norm = grad_norm(model_.model->units(), model_.groups.shard, model_.groups.tp,
                          model_.groups.pp, model_.counted_units());
  r.updated = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  if (r.updated) {
    if (before_update) before_update();
    // Clipping scales the gradients as AdamW reads them (the same products as scaling them in
    // place first, one pass over them fewer).
    optimizer_.step(float(lr), clip_grad_scale(r.grad_norm, max_norm_));
    r.notes = model_.model->after_update(model_.groups.dp, model_.groups.pp);
  }
  return r;
}

}  // namespace loom
