#include "parallel/pipeline/stage_split.hpp"

#include <charconv>

#include "core/error.hpp"

namespace loom::pp {

std::vector<int> parse_stage_layers(const std::string& text) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::string cell = text.substr(pos, end - pos);
    while (!cell.empty() && cell.front() == ' ') cell.erase(cell.begin());
    while (!cell.empty() && cell.back() == ' ') cell.pop_back();
    int n = 0;
    auto r = std::from_chars(cell.data(), cell.data() + cell.size(), n);
    LOOM_CHECK(!cell.empty() && r.ec == std::errc() && r.ptr == cell.data() + cell.size() && n >= 1,
               "parallelism.pp_stage_layers = \"", text, "\": \"", cell,
               "\" is not a positive integer; expected the blocks of every stage, such as "
               "\"4,5,5,4\" (every stage holds at least one block)");
    out.push_back(n);
    pos = end + 1;
  }
  return out;
}

std::vector<UnitRange> stage_units(int num_layers, int stages, const std::vector<int>& layers) {
  LOOM_CHECK(stages >= 1, "pipeline: ", stages, " stages; expected at least one");
  std::vector<UnitRange> out;
  const size_t head = size_t(num_layers) + 1;
  if (!layers.empty()) {
    LOOM_CHECK(int(layers.size()) == stages, "parallelism.pp_stage_layers has ", layers.size(),
               " entries; expected one per stage: pp x pp_stages_per_rank = ", stages);
    int sum = 0;
    for (int n : layers) sum += n;
    LOOM_CHECK(sum == num_layers, "parallelism.pp_stage_layers sums to ", sum,
               " layers; expected the model's num_hidden_layers = ", num_layers);
    size_t first = 0;
    for (int s = 0; s < stages; ++s) {
      size_t last = first + size_t(layers[size_t(s)]) + (s == 0 ? 1 : 0);
      if (s == stages - 1) last = head + 1;
      out.push_back({first, last});
      first = last;
    }
    return out;
  }
  const int units = num_layers + 2;
  // Every stage needs a block, or a stage would be only the embedding or only the head.
  LOOM_CHECK(num_layers >= stages, "pipeline: ", stages,
             " stages (parallelism.pp x pp_stages_per_rank) but the model has ", num_layers,
             " layers (num_hidden_layers); expected at least one layer per stage");
  size_t first = 0;
  for (int s = 0; s < stages; ++s) {
    const size_t n = size_t(units / stages + (s < units % stages ? 1 : 0));
    out.push_back({first, first + n});
    first += n;
  }
  // With nearly as many stages as blocks the even split of units can leave the first stage only
  // the embedding or the last only the head: then the blocks are split evenly instead.
  if (out.front().second == 1 || out.back().first == head) {
    std::vector<int> even;
    for (int s = 0; s < stages; ++s)
      even.push_back(num_layers / stages + (s < num_layers % stages));
    return stage_units(num_layers, stages, even);
  }
  return out;
}

std::vector<UnitRange> layer_ranges_to_blocks(const std::vector<UnitRange>& ranges,
                                              const std::vector<int>& blocks_per_layer) {
  // start[u]: the first block unit of layer unit u (0 the embedding, L + 1 the head, L + 2 the
  // end).
  std::vector<size_t> start{0, 1};
  for (int n : blocks_per_layer) {
    LOOM_CHECK(n >= 1, "pipeline: a layer of ", n, " blocks; expected at least one");
    start.push_back(start.back() + size_t(n));
  }
  start.push_back(start.back() + 1);
  std::vector<UnitRange> out;
  for (const auto& [first, last] : ranges) {
    LOOM_CHECK(first <= last && last < start.size(), "pipeline: units [", first, ", ", last,
               ") of a model of ", blocks_per_layer.size(), " layers");
    out.push_back({start[first], start[last]});
  }
  return out;
}

}  // namespace loom::pp
