#include "parallel/layers/activation_checkpoint.hpp"

#include <charconv>

#include "core/error.hpp"

namespace loom {

ActivationCheckpoint ActivationCheckpoint::parse(const std::string& mode,
                                                 const std::string& selective_option) {
  ActivationCheckpoint ac;
  if (mode == "none") return ac;
  if (mode == "full") {
    ac.mode = Mode::full;
    return ac;
  }
  LOOM_CHECK(mode == "selective", "activation_checkpoint.mode = \"", mode,
             "\": expected \"none\", \"full\" or \"selective\"");
  if (selective_option == "op") {
    ac.mode = Mode::op;
    return ac;
  }
  int n = 0;
  const char* end = selective_option.data() + selective_option.size();
  auto r = std::from_chars(selective_option.data(), end, n);
  LOOM_CHECK(!selective_option.empty() && r.ec == std::errc() && r.ptr == end && n >= 1,
             "activation_checkpoint.selective_option = \"", selective_option,
             "\": expected \"op\" or a positive integer N");
  ac.mode = Mode::full;
  ac.every_n = n;
  return ac;
}

ActivationCheckpoint::Mode ActivationCheckpoint::block_mode(int64_t layer) const {
  if (mode == Mode::full && layer % every_n != 0) return Mode::none;
  return mode;
}

int64_t ActivationCheckpoint::recomputed_blocks(int64_t layers) const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers; ++l) n += block_mode(l) == Mode::full;
  return n;
}

}  // namespace loom
