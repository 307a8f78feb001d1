#include "train/optimizer.hpp"

#include <cmath>

#include "kernels/cpu/adamw.hpp"
#include "kernels/cpu/cast.hpp"

namespace loom {

AdamW::AdamW(std::vector<ParamUnit*> units, const AdamWConfig& config)
    : units_(std::move(units)), config_(config) {
  for (ParamUnit* u : units_) {
    m_.push_back(Tensor::zeros({u->numel()}, DType::f32, u->flat().device()));
    v_.push_back(Tensor::zeros({u->numel()}, DType::f32, u->flat().device()));
  }
}

size_t AdamW::state_bytes() const {
  size_t n = 0;
  for (size_t i = 0; i < m_.size(); ++i) n += m_[i].nbytes() + v_[i].nbytes();
  return n;
}

void AdamW::step(float lr) {
  ++step_;
  for (size_t i = 0; i < units_.size(); ++i) {
    ParamUnit& u = *units_[i];
    if (u.flat().device() == Device::meta) continue;
    for (auto& p : u.params()) {
      cpu::AdamWArgs a{lr, config_.beta1, config_.beta2, config_.eps,
                       p.spec.decay ? config_.weight_decay : 0.0f, step_};
      const int64_t n = p.value.numel();
      cpu::adamw_step(a, p.value.data<float>(), p.grad.data<float>(),
                      m_[i].data<float>() + p.offset, v_[i].data<float>() + p.offset, n,
                      u.has_bf16() ? p.value_bf16.data<bf16>() : nullptr);
    }
  }
}

double clip_grad_norm(const std::vector<ParamUnit*>& units, double max_norm) {
  double ss = 0;
  for (ParamUnit* u : units)
    if (u->grad_flat().device() != Device::meta)
      ss += cpu::sum_squares(u->grad_flat().data<float>(), u->numel());
  const double norm = std::sqrt(ss);
  if (max_norm > 0 && norm > max_norm) {
    // PyTorch adds 1e-6 to the norm in the denominator; do the same so clipped runs match.
    const float s = float(max_norm / (norm + 1e-6));
    for (ParamUnit* u : units)
      if (u->grad_flat().device() != Device::meta)
        cpu::scale_inplace(u->grad_flat().data<float>(), u->numel(), s);
  }
  return norm;
}

}  // namespace loom
