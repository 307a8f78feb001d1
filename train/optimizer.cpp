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
    // One fused call per run of adjacent parameters with the same weight decay (a block: its norm,
    // q..o, its norm, gate..down): few passes, each over a long contiguous range.
    const auto& ps = u.params();
    for (size_t first = 0; first < ps.size();) {
      size_t last = first + 1;
      while (last < ps.size() && ps[last].spec.decay == ps[first].spec.decay) ++last;
      const int64_t begin = ps[first].offset;
      const int64_t n = ps[last - 1].offset + ps[last - 1].value.numel() - begin;
      cpu::AdamWArgs a{lr, config_.beta1, config_.beta2, config_.eps,
                       ps[first].spec.decay ? config_.weight_decay : 0.0f, step_};
      cpu::adamw_step(a, u.flat().data<float>() + begin, u.grad_flat().data<float>() + begin,
                      m_[i].data<float>() + begin, v_[i].data<float>() + begin, n,
                      u.has_bf16() ? u.flat_bf16().data<bf16>() + begin : nullptr);
      first = last;
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
