#pragma once
// The data loader of docs/design.md decision 11. With G = local_batch_size x dp x grad_accum_steps
// samples per step, sample j of step s is the window of seq_len + 1 tokens starting at token
// (s*G + j) * seq_len of the stream (wrapping), or, with shuffle, at sample index
// perm_epoch(s*G + j) where the permutation of each epoch's samples is seeded and layout-free.
// Micro-step m on data-parallel rank r takes samples j = (m*dp + r)*local_batch_size + i. The
// loader has no state beyond the step it is at, which checkpoints save.
#include <cstdint>
#include <vector>

#include "data/token_shard.hpp"

namespace loom {

struct DataLoaderConfig {
  int64_t local_batch_size = 1, seq_len = 1, grad_accum_steps = 1;
  int64_t dp_rank = 0, dp_size = 1;
  bool shuffle = false;
  uint64_t seed = 0;
};

struct MicroBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs, targets;  // [B, T] each
};

class DataLoader {
 public:
  // Keeps a reference to `stream`, which must outlive the loader. get() is const and thread-safe.
  DataLoader(const TokenStream& stream, const DataLoaderConfig& config);
  int64_t samples_per_step() const;   // G
  int64_t samples_per_epoch() const;  // floor((stream size - 1) / seq_len), at least 1
  // The micro-batch `micro` (< grad_accum_steps) of step `step` for this rank.
  MicroBatch get(int64_t step, int64_t micro) const;

 private:
  int64_t sample_start(int64_t global_sample) const;  // token offset of the window
  const TokenStream& stream_;
  DataLoaderConfig c_;
};

}  // namespace loom
