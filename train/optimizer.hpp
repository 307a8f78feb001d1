#pragma once
// AdamW over the model's parameter units: fp32 master weights and moments (one flat buffer per
// unit, like the weights), weight decay only on parameters marked for it, and the bf16 mirrors
// refreshed in the same pass. Sharded units: the moments have the shard's size, and the update
// runs over this rank's shard only (a sharded unit has no mirror: its gather rounds to bf16).
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/param_unit.hpp"

namespace loom {

namespace dist {
class ProcessGroup;
}

struct AdamWConfig {
  float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

class AdamW {
 public:
  AdamW(std::vector<ParamUnit*> units, const AdamWConfig& config);
  // One update at learning rate `lr` (the schedule's value for this step), each gradient
  // multiplied by `grad_scale` as it is read (clip_grad_scale: clipping without a pass of its own).
  void step(float lr, float grad_scale = 1);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }  // restoring a checkpoint
  size_t state_bytes() const;
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }

 private:
  std::vector<ParamUnit*> units_;
  AdamWConfig config_;
  std::vector<Tensor> m_, v_;  // per unit, flat, the size of its shard
  int64_t step_ = 0;
};

// Global L2 norm of all gradients; if max_norm > 0 and the norm exceeds it, scales the gradients
// by max_norm / norm (PyTorch's clip_grad_norm_). Returns the norm before clipping.
// `shard_group`: the ranks over which sharded units are split (their gradient shards are summed
// over it, in rank order, so every rank gets the same norm); nullptr when nothing is sharded.
// `tp_group`: the tensor-parallel group (split parameters summed over it, replicated ones
// counted once); nullptr without tensor parallelism. `pp_group`: the pipeline ranks, each holding
// the gradients of its stages' units only; nullptr without pp. `counted`: per unit, whether
// this rank counts it (pp: the units of its stages, not a tied embedding's replica on the last
// stage); empty: every unit. The units' sums are added in unit order, so the norm's bits do not
// depend on how the units are spread over pp ranks.
double clip_grad_norm(const std::vector<ParamUnit*>& units, double max_norm,
                      dist::ProcessGroup* shard_group = nullptr,
                      dist::ProcessGroup* tp_group = nullptr,
                      dist::ProcessGroup* pp_group = nullptr,
                      const std::vector<bool>& counted = {});

// clip_grad_norm without the scaling: the global norm, the gradients unchanged.
double grad_norm(const std::vector<ParamUnit*>& units, dist::ProcessGroup* shard_group = nullptr,
                 dist::ProcessGroup* tp_group = nullptr, dist::ProcessGroup* pp_group = nullptr,
                 const std::vector<bool>& counted = {});

// The factor clip_grad_norm scales the gradients by: max_norm / (norm + 1e-6) when max_norm > 0
// and the norm exceeds it (PyTorch adds the 1e-6 too), else 1.
float clip_grad_scale(double norm, double max_norm);

}  // namespace loom
