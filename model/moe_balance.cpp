#include "model/moe_balance.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "distributed/group_sum.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

// fn(host view) on `t`: its own memory on the CPU, a host copy written back elsewhere.
template <class Fn>
void edit_on_host(Tensor& t, Fn&& fn) {
  Tensor h = t.on_host();
  fn(h);
  if (t.device() != Device::cpu) t.copy_from(h);
}

}  // namespace

void add_to_param(ParamUnit& unit, size_t param, const std::vector<float>& delta) {
  Param& p = unit.params()[param];
  LOOM_CHECK(int64_t(delta.size()) == p.value.numel() || unit.sharded(), unit.name(), ": ",
             delta.size(), " values for ", p.spec.name, " of ", shape_numel(p.spec.shape));
  if (!ops::computes(unit.device())) return;
  if (!unit.sharded()) {
    edit_on_host(p.value, [&](Tensor& h) {
      for (size_t e = 0; e < delta.size(); ++e) h.data<float>()[e] += delta[e];
    });
    // The mirror follows the master, as AdamW keeps it.
    if (p.value_bf16.defined()) {
      const Tensor v = p.value.on_host();
      edit_on_host(p.value_bf16, [&](Tensor& h) {
        for (size_t e = 0; e < delta.size(); ++e)
          h.data<bf16>()[e] = float_to_bf16(v.data<float>()[e]);
      });
    }
    return;
  }
  for (const ShardSlice& s : unit.shard_slices()) {
    if (s.param != param) continue;
    Tensor part = unit.master_shard().narrow(0, s.shard_offset, s.count);
    edit_on_host(part, [&](Tensor& h) {
      for (int64_t i = 0; i < s.count; ++i) h.data<float>()[i] += delta[size_t(s.begin + i)];
    });
  }
}

ExpertBalance::ExpertBalance(std::vector<int64_t> layers, int64_t E, int64_t k, double rate,
                             double threshold, bool capacity)
    : layers_(std::move(layers)),
      E_(E),
      k_(k),
      rate_(rate),
      threshold_(threshold),
      capacity_(capacity),
      warned_(layers_.size(), false) {}

void ExpertBalance::add(const std::vector<double>& layer_counts) {
  if (layer_counts.empty()) return;  // meta: nothing routed
  LOOM_CHECK(layer_counts.size() == layers_.size() * size_t(E_),
             "expert loads: ", layer_counts.size(), " counts for ", layers_.size(),
             " sparse layers of ", E_, " experts");
  if (open_.empty()) open_.assign(layer_counts.size(), 0.0);
  for (size_t i = 0; i < open_.size(); ++i) open_[i] += layer_counts[i];
}

void ExpertBalance::close_step() {
  closed_ = std::move(open_);
  open_.clear();
}

std::vector<std::string> ExpertBalance::after_update(
    dist::ProcessGroup* dp, dist::ProcessGroup* cp, dist::ProcessGroup* pp,
    const std::vector<std::pair<ParamUnit*, size_t>>& biases) {
  const size_t L = layers_.size(), E = size_t(E_);
  std::vector<double> loads = closed_;
  loads.resize(L * E, 0.0);  // a rank that routed nothing (meta) still takes part
  // Counts of whole choices: the sums are exact in any order, the same bits on every rank.
  loads = group_sum_each(pp, group_sum_each(cp, group_sum_each(dp, loads)));
  loads_ = loads;
  std::vector<std::string> lines;
  for (size_t l = 0; l < L; ++l) {
    const double* n = loads.data() + l * E;
    double total = 0;
    for (size_t e = 0; e < E; ++e) total += n[e];
    if (total == 0) continue;  // meta, or no token
    const double mean = total / double(E);
    if (rate_ > 0 && !biases.empty()) {
      std::vector<float> delta(E, 0.0f);
      for (size_t e = 0; e < E; ++e)
        delta[e] = n[e] < mean ? float(rate_) : n[e] > mean ? -float(rate_) : 0.0f;
      add_to_param(*biases[l].first, biases[l].second, delta);
    }
    const size_t top = size_t(std::max_element(n, n + E) - n);
    const double ratio = n[top] / mean;
    const std::string layer = str_cat("layer ", layers_[l]);
    if (ratio >= threshold_ && !warned_[l]) {
      warned_[l] = true;
      const double tokens = total / double(k_);
      lines.push_back(str_cat(
          "warning: ", layer, "'s router is running away: expert ", top, " got ", int64_t(n[top]),
          " of the step's ", int64_t(tokens), " tokens (load max/mean ", ratio, " >= ", threshold_,
          ", moe.load_warning; ", double(E_) / double(k_), ": every token), ",
          capacity_ ? "the choices past its capacity are dropped (the `dropped` metric)"
                    : "dropless: all its rows are computed"));
    } else if (ratio < threshold_ && warned_[l]) {
      warned_[l] = false;
      lines.push_back(str_cat(layer, "'s load max/mean is back under ", threshold_, ": ", ratio));
    }
  }
  return lines;
}

}  // namespace loom
