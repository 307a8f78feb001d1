#pragma once
// Which units each pipeline stage holds. Units are in LlamaModel::units() order (the embedding,
// blocks 0..L-1, the head); a stage is a contiguous range [first, last) of them, the embedding on
// the first stage and the head on the last. `pp_stage_layers` gives the blocks of every stage
// (Megatron's explicit split); by default the L + 2 units are split as evenly as possible, the
// embedding and the head each weighted as one layer (torchtitan's weighting), the larger stages
// first.
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace loom::pp {

using UnitRange = std::pair<size_t, size_t>;  // [first, last) in units() order

// "4,5,5,4" -> {4, 5, 5, 4}; fails naming parallelism.pp_stage_layers and the expected form.
std::vector<int> parse_stage_layers(const std::string& text);
// `layers` empty: balanced. Fails naming the keys when a stage would be empty, when the explicit
// split does not have `stages` entries or does not sum to num_layers.
std::vector<UnitRange> stage_units(int num_layers, int stages, const std::vector<int>& layers = {});

}  // namespace loom::pp
