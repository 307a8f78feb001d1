#include "train/optimizer.hpp"

#include <cmath>

#include "dist/process_group.hpp"
#include "kernels/cpu/adamw.hpp"
#include "kernels/cpu/cast.hpp"

namespace loom {

AdamW::AdamW(std::vector<ParamUnit*> units, const AdamWConfig& config)
    : units_(std::move(units)), config_(config) {
  for (ParamUnit* u : units_) {
    m_.push_back(Tensor::zeros({u->shard_numel()}, DType::f32, u->device()));
    v_.push_back(Tensor::zeros({u->shard_numel()}, DType::f32, u->device()));
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
    if (u.device() == Device::meta) continue;
    // One fused call per run of adjacent parameters with the same weight decay (a block: its norm,
    // q..o, its norm, gate..down), cut to this rank's shard: few passes, each over a long
    // contiguous range. Offsets are within the shard (the whole flat buffer when unsharded).
    const auto& ps = u.params();
    const auto slices = u.shard_slices();
    float* w = u.master_shard().data<float>();
    float* g = u.grad_shard().data<float>();
    bf16* mirror = !u.sharded() && u.has_bf16() ? u.flat_bf16().data<bf16>() : nullptr;
    for (size_t first = 0; first < slices.size();) {
      const bool decay = ps[slices[first].param].spec.decay;
      size_t last = first + 1;
      while (last < slices.size() && ps[slices[last].param].spec.decay == decay) ++last;
      const int64_t begin = slices[first].shard_offset;
      const int64_t n = slices[last - 1].shard_offset + slices[last - 1].count - begin;
      cpu::AdamWArgs a{
          lr,   config_.beta1, config_.beta2, config_.eps, decay ? config_.weight_decay : 0.0f,
          step_};
      cpu::adamw_step(a, w + begin, g + begin, m_[i].data<float>() + begin,
                      v_[i].data<float>() + begin, n, mirror ? mirror + begin : nullptr);
      first = last;
    }
  }
}

double clip_grad_norm(const std::vector<ParamUnit*>& units, double max_norm,
                      dist::ProcessGroup* shard_group) {
  double ss = 0;
  for (ParamUnit* u : units)
    if (u->device() != Device::meta)
      ss += cpu::sum_squares(u->grad_shard().data<float>(), u->shard_numel());
  if (shard_group && shard_group->size() > 1) {
    // Collectives carry no f64: each rank's sum goes as two floats (hi + lo, about 48 bits), and
    // every rank adds the gathered parts in rank order, so all ranks clip by the same factor.
    const int n = shard_group->size();
    Tensor mine = Tensor::empty({2}, DType::f32);
    Tensor all = Tensor::empty({2 * n}, DType::f32);
    const float hi = float(ss);
    mine.data<float>()[0] = hi;
    mine.data<float>()[1] = float(ss - double(hi));
    shard_group->all_gather(mine, all)->wait();
    ss = 0;
    for (int r = 0; r < n; ++r)
      ss += double(all.data<float>()[2 * r]) + double(all.data<float>()[2 * r + 1]);
  }
  const double norm = std::sqrt(ss);
  if (max_norm > 0 && norm > max_norm) {
    // PyTorch adds 1e-6 to the norm in the denominator; do the same so clipped runs match.
    const float s = float(max_norm / (norm + 1e-6));
    for (ParamUnit* u : units)
      if (u->device() != Device::meta)
        cpu::scale_inplace(u->grad_shard().data<float>(), u->shard_numel(), s);
  }
  return norm;
}

}  // namespace loom
