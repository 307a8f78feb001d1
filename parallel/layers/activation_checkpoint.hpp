#pragma once
// Activation checkpointing (docs/design.md decision 8; docs/decisions/activation-checkpointing.md):
// what a layer's forward saves versus what its backward recomputes, for any model. Recomputation
// runs the same deterministic kernels on the same inputs, so every mode gives bit-identical
// results.
#include <cstdint>
#include <string>

namespace loom {

struct ActivationCheckpoint {
  enum class Mode {
    none,  // save everything
    full,  // save the block input only; backward re-runs the block's forward first
    op,    // save GEMM and attention outputs; recompute the norm and activation outputs they read
  };
  Mode mode = Mode::none;
  int every_n = 1;  // full: only blocks with layer % every_n == 0; the others save everything
  // [activation_checkpoint] mode ("none", "full", "selective") and selective_option ("op" or a
  // positive N: every N-th block full); anything else is a loom::Error.
  static ActivationCheckpoint parse(const std::string& mode, const std::string& selective_option);
  Mode block_mode(int64_t layer) const;
  // Blocks among `layers` whose forward runs again in backward (full).
  int64_t recomputed_blocks(int64_t layers) const;
  bool operator==(const ActivationCheckpoint&) const = default;
};

}  // namespace loom
