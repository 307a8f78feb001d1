#include "train/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "core/error.hpp"
#include "distributed/group_sum.hpp"
#include "distributed/process_group.hpp"
#include "ops/ops.hpp"

namespace loom {

AdamW::AdamW(std::vector<ParamUnit*> units, const AdamWConfig& config)
    : units_(std::move(units)), config_(config) {
  // The moments live where the master shard does (host memory under CPU offload).
  for (ParamUnit* u : units_) {
    const Pool pool = u->master_shard().pool();
    m_.push_back(Tensor::zeros({u->shard_numel()}, DType::f32, u->device(), pool));
    v_.push_back(Tensor::zeros({u->shard_numel()}, DType::f32, u->device(), pool));
  }
}

size_t AdamW::state_bytes() const {
  size_t n = 0;
  for (size_t i = 0; i < m_.size(); ++i) n += m_[i].nbytes() + v_[i].nbytes();
  return n;
}

void AdamW::step(float lr, float grad_scale) {
  ++step_;
  for (size_t i = 0; i < units_.size(); ++i) {
    ParamUnit& u = *units_[i];
    // Units elsewhere are other pp ranks'; on meta (a plan) there is nothing to compute.
    if (!holds_data(u.device())) continue;
    // One fused call per run of adjacent parameters with the same weight decay (a block: its norm,
    // q..o, its norm, gate..down), cut to this rank's shard: few passes, each over a long
    // contiguous range. Offsets are within the shard (the whole flat buffer when unsharded).
    const auto& ps = u.params();
    const auto slices = u.shard_slices();
    Tensor w = u.master_shard(), g = u.grad_shard();
    const bool mirrored = !u.sharded() && u.has_bf16();
    Tensor mirror = mirrored ? u.flat_bf16() : Tensor();
    for (size_t first = 0; first < slices.size();) {
      const bool decay = ps[slices[first].param].spec.decay;
      size_t last = first + 1;
      while (last < slices.size() && ps[slices[last].param].spec.decay == decay) ++last;
      const int64_t begin = slices[first].shard_offset;
      const int64_t n = slices[last - 1].shard_offset + slices[last - 1].count - begin;
      const ops::AdamWStep a{
          lr,    config_.beta1, config_.beta2, config_.eps, decay ? config_.weight_decay : 0.0f,
          step_, grad_scale};
      Tensor wr = w.narrow(0, begin, n), mr = m_[i].narrow(0, begin, n),
             vr = v_[i].narrow(0, begin, n);
      Tensor mirror_r = mirrored ? mirror.narrow(0, begin, n) : Tensor();
      ops::adamw_step(a, wr, g.narrow(0, begin, n), mr, vr, mirrored ? &mirror_r : nullptr);
      first = last;
    }
  }
}

double grad_norm(const std::vector<ParamUnit*>& units, dist::ProcessGroup* shard_group,
                 dist::ProcessGroup* tp_group, dist::ProcessGroup* pp_group,
                 const std::vector<bool>& counted) {
  const int tp = tp_group ? tp_group->size() : 1;
  LOOM_CHECK(counted.empty() || counted.size() == units.size(), "grad_norm: ", counted.size(),
             " counted flags for ", units.size(), " units");
  // One squared sum per unit, each reduced over the groups, then the units added in unit order on
  // every rank: the same additions in the same order whatever the pp split (a unit's sum comes
  // from its one owner, the others adding exact zeros), so pp changes no bit of the clip factor.
  // The pieces are summed in one op (on a GPU, one read back for the step), then folded per unit
  // in order.
  struct Piece {
    size_t unit;
    bool replicated;  // a parameter tp does not split
  };
  std::vector<Piece> pieces;
  std::vector<Tensor> parts;
  for (size_t i = 0; i < units.size(); ++i) {
    ParamUnit* u = units[i];
    if (!holds_data(u->device()) || (!counted.empty() && !counted[i])) continue;
    const Tensor g = u->grad_shard();
    if (tp == 1) {
      pieces.push_back({i, false});
      parts.push_back(g.narrow(0, 0, u->shard_numel()));
      continue;
    }
    for (const ShardSlice& s : u->shard_slices()) {
      pieces.push_back({i, u->params()[s.param].spec.split == TpSplit::none});
      parts.push_back(g.narrow(0, s.shard_offset, s.count));
    }
  }
  // Devices may differ between units (CPU offload keeps some on the host): one call per run of
  // units on one device.
  std::vector<double> sums(parts.size(), 0.0);
  for (size_t a = 0; a < parts.size();) {
    size_t b = a + 1;
    while (b < parts.size() && parts[b].device() == parts[a].device()) ++b;
    const std::vector<double> s =
        ops::sum_squares_each(std::span<const Tensor>(parts).subspan(a, b - a));
    std::copy(s.begin(), s.end(), sums.begin() + std::ptrdiff_t(a));
    a = b;
  }
  // Parameters that tensor parallelism does not split (norms) hold the same gradient on every tp
  // rank: each rank counts 1/tp of them (exact for tp a power of two), so the sum over tp counts
  // them once.
  std::vector<double> per_unit(units.size(), 0.0);
  for (size_t j = 0; j < pieces.size(); ++j)
    per_unit[pieces[j].unit] += pieces[j].replicated ? sums[j] / tp : sums[j];
  per_unit =
      group_sum_each(pp_group, group_sum_each(tp_group, group_sum_each(shard_group, per_unit)));
  double ss = 0;
  for (double x : per_unit) ss += x;
  return std::sqrt(ss);
}

float clip_grad_scale(double norm, double max_norm) {
  return max_norm > 0 && norm > max_norm ? float(max_norm / (norm + 1e-6)) : 1.0f;
}

double clip_grad_norm(const std::vector<ParamUnit*>& units, double max_norm,
                      dist::ProcessGroup* shard_group, dist::ProcessGroup* tp_group,
                      dist::ProcessGroup* pp_group, const std::vector<bool>& counted) {
  const double norm = grad_norm(units, shard_group, tp_group, pp_group, counted);
  const float s = clip_grad_scale(norm, max_norm);
  if (s != 1.0f)
    for (ParamUnit* u : units)
      if (holds_data(u->device())) {
        Tensor g = u->grad_shard().narrow(0, 0, u->shard_numel());
        ops::scale_inplace(g, s);
      }
  return norm;
}

}  // namespace loom
