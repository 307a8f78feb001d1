#pragma once
// Which units each pipeline stage holds. Units are in Model::units() order (the embedding,
// blocks 0..L-1, the head); a stage is a contiguous range [first, last) of them, the embedding on
// the first stage and the head on the last. `pp_stage_layers` gives the layers of every stage
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
// The ranges of stage_units (one unit per layer) in the units of a model whose layer l is
// blocks_per_layer[l] consecutive blocks (a mixture of experts' sparse layer: its attention block
// and its experts block, which reads the routing the first saved): a stage holds whole layers.
std::vector<UnitRange> layer_ranges_to_blocks(const std::vector<UnitRange>& ranges,
                                              const std::vector<int>& blocks_per_layer);

}  // namespace loom::pp
