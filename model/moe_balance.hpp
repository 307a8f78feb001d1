#pragma once
// What a mixture of experts does with its experts' loads after each optimizer step
// (docs/decisions/moe.md): each sparse layer's choice counts over the step's tokens on every rank
// (its micro-batches' RouterStats::layer_counts, summed over the data-parallel and cp groups the
// tokens are spread over, and over pp from the head's rank: integers in doubles, so every rank
// holds the same bits)
// - move the layer's selection-only bias (DeepSeek-V3's auxiliary-loss-free balancing,
//   MoeConfig::expert_bias) by b_e += rate x sign(mean load - load_e), in f32, where this rank
//   keeps it (its shard of the unit's master weights; every rank the same values);
// - are checked against the runaway threshold (MoeConfig::load_warning_threshold): a layer whose
//   busiest expert's load over the mean reaches it is reported once, and again when it is back
//   under (a line for the log, never an error: with a capacity the excess is dropped and counted,
//   dropless every row is computed).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "distributed/process_group.hpp"
#include "model/param_unit.hpp"

namespace loom {

class ExpertBalance {
 public:
  // `layers`: the model's sparse layers in the order they run; E experts, k choices per token.
  ExpertBalance(std::vector<int64_t> layers, int64_t E, int64_t k, double rate, double threshold,
                bool capacity);

  // A micro-batch's RouterStats::layer_counts (its sparse layers in order, E each; empty on meta),
  // added to the step's.
  void add(const std::vector<double>& layer_counts);
  // Closes the step's window (Model::take_step_metrics): after_update reads what it holds.
  void close_step();
  // The closed window summed over `dp`, `cp` and `pp` (nullptr: none; on meta too, for the same
  // traffic; under pp the micro-batches' loads are on the head's rank, zeros elsewhere: every rank
  // gets every layer's); with a rate, each layer's bias moved where this rank holds it (`biases`:
  // per sparse layer, its unit and the bias's index there; empty without the bias); returns the
  // lines for the log.
  std::vector<std::string> after_update(dist::ProcessGroup* dp, dist::ProcessGroup* cp,
                                        dist::ProcessGroup* pp,
                                        const std::vector<std::pair<ParamUnit*, size_t>>& biases);
  // The last after_update's loads: per sparse layer, E counts over the step's tokens.
  const std::vector<double>& step_loads() const { return loads_; }

 private:
  std::vector<int64_t> layers_;
  int64_t E_, k_;
  double rate_, threshold_;
  bool capacity_;
  std::vector<double> open_, closed_, loads_;
  std::vector<bool> warned_;
};

// Adds delta[e] to element e of parameter `param` ([E] f32) of `unit` wherever this rank keeps it:
// the whole tensor of an unsharded unit (and its bf16 mirror), the elements in this rank's master
// shard of a sharded one (FSDP gathers them before the next forward). Nothing on meta.
void add_to_param(ParamUnit& unit, size_t param, const std::vector<float>& delta);

}  // namespace loom
