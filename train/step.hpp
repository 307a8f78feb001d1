#pragma once
// The one training step of `loom train`, `loom bench step` and `loom plan`: zero the gradients;
// the forward/backward of the step's micro-batches (ParallelModel::forward_backward_step: one
// after the other, or a pipeline schedule's rounds; the parallel model's hooks reduce the
// gradients as they go); the step's last reductions; the loss
// summed over the data-parallel ranks; the gradient norm clipped; AdamW at the given rate.
// The trainer keeps the policy around it (logging, validation, checkpoints, stopping).
#include <cstdint>
#include <functional>

#include "data/data_loader.hpp"
#include "parallel/parallelize.hpp"
#include "train/optimizer.hpp"

namespace loom {

struct StepResult {
  double loss = 0;       // mean over the step's tokens on every rank
  double grad_norm = 0;  // before clipping
  bool updated = false;  // false: the loss or the norm is not finite, and AdamW did not run
  // The model's own (Model::take_step_metrics), each the mean over the data-parallel ranks (the
  // head's stage's, with pp).
  std::vector<ModelMetric> model_metrics;
  // The model's lines for the log after the update (Model::after_update: a runaway router).
  std::vector<std::string> notes;
};

class TrainStep {
 public:
  // tokens_per_step: the global batch's tokens (micro-batches x B x T x dp), each micro-batch's
  // loss is scaled by its inverse so the summed gradients are those of the step's mean loss.
  TrainStep(ParallelModel& model, AdamW& optimizer, double max_norm, int64_t tokens_per_step);

  // `batch(m)`: micro-batch m of `micro_batches`, valid until the next call. A step whose loss or
  // gradient norm is not finite leaves the weights as they were (the caller decides to stop).
  // `before_update`: runs just before AdamW changes the weights and moments (an async
  // checkpoint save copies what it has not written yet).
  StepResult run(int64_t micro_batches, const std::function<const MicroBatch&(int64_t)>& batch,
                 double lr, const std::function<void()>& before_update = {});

 private:
  ParallelModel& model_;
  AdamW& optimizer_;
  double max_norm_;
  int64_t tokens_per_step_;
};

}  // namespace loom
