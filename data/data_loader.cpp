#include "data/data_loader.hpp"

#include <algorithm>
#include <array>

#include "core/error.hpp"
#include "core/philox.hpp"

// docs/design.md decision 11, which this file implements:
//   "The global batch of a step does not depend on the layout: with G = local_batch_size x
//   dp_replicate x dp_shard x grad_accum_steps samples per step, sample j of step s is the window
//   of seq_len + 1 tokens starting at token (s*G + j) * seq_len of the training shards taken as
//   one stream (inputs: its first seq_len tokens, targets: its last seq_len), wrapping at the
//   end. Micro-step m on data-parallel rank r (dp = dp_replicate x dp_shard) takes samples
//   j = (m*dp + r)*local_batch_size + i for i < local_batch_size; the cp, tp and pp ranks of one
//   dp rank share its samples. `[data] shuffle = true` permutes sample indices per epoch with a
//   seeded, layout-independent permutation."
//
// The shuffle: an epoch is the S = floor((N - 1) / seq_len) windows that fit in the N tokens
// without wrapping, and global sample g = e*S + k (epoch e) starts at token pi_e(k) * seq_len,
// where pi_e is a permutation of [0, S) that depends only on (seed, e). pi_e is a Feistel network
// whose round function is Philox keyed by the seed, over the smallest domain of 4^h >= S
// elements, restricted to [0, S) by cycle walking. It costs O(1) time and no memory per sample
// (a Fisher-Yates table for 10^12 tokens would take gigabytes per rank), and every rank of every
// layout computes the same pi_e.

namespace loom {

namespace {

constexpr int kFeistelRounds = 6;  // 4 make a pseudo-random permutation (Luby-Rackoff); 2 spare

// pi(k) for k < S over the domain of 2^(2*half) elements.
uint64_t feistel_permute(uint64_t k, uint64_t S, int half, uint64_t key, uint64_t epoch) {
  const uint64_t mask = (uint64_t(1) << half) - 1;
  const std::array<uint32_t, 2> pkey = {uint32_t(key), uint32_t(key >> 32)};
  uint64_t x = k;
  // Cycle walking: the permutation of the larger domain maps [0, S) into itself once its
  // out-of-range values are skipped along their cycles; each cycle through k returns to k, so
  // this ends, and since the domain is < 4S the expected number of walks is < 4.
  do {
    uint64_t left = x >> half, right = x & mask;
    for (int round = 0; round < kFeistelRounds; ++round) {
      const auto r = philox4x32({uint32_t(right), uint32_t(right >> 32) ^ uint32_t(round << 8),
                                 uint32_t(epoch), uint32_t(epoch >> 32)},
                                pkey);
      const uint64_t f = (uint64_t(r[1]) << 32 | r[0]) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = left << half | right;
  } while (x >= S);
  return x;
}

}  // namespace

DataLoader::DataLoader(const TokenStream& stream, const DataLoaderConfig& config)
    : stream_(stream), c_(config) {
  LOOM_CHECK(c_.local_batch_size >= 1, "data loader: local_batch_size must be >= 1, got ",
             c_.local_batch_size);
  LOOM_CHECK(c_.seq_len >= 1, "data loader: seq_len must be >= 1, got ", c_.seq_len);
  LOOM_CHECK(c_.grad_accum_steps >= 1, "data loader: grad_accum_steps must be >= 1, got ",
             c_.grad_accum_steps);
  LOOM_CHECK(c_.dp_size >= 1, "data loader: dp_size must be >= 1, got ", c_.dp_size);
  LOOM_CHECK(c_.dp_rank >= 0 && c_.dp_rank < c_.dp_size, "data loader: dp_rank ", c_.dp_rank,
             " is outside [0, ", c_.dp_size, ")");
  LOOM_CHECK(stream_.size() >= 1, "data loader: the token stream is empty");
}

int64_t DataLoader::samples_per_step() const {
  return c_.local_batch_size * c_.dp_size * c_.grad_accum_steps;
}

int64_t DataLoader::samples_per_epoch() const {
  const uint64_t n = stream_.size();
  return std::max<int64_t>(1, int64_t((n - 1) / uint64_t(c_.seq_len)));
}

int64_t DataLoader::sample_start(int64_t global_sample) const {
  const uint64_t N = stream_.size(), T = uint64_t(c_.seq_len), g = uint64_t(global_sample);
  if (!c_.shuffle) {
    // (g * T) mod N without overflow for any step count.
    return int64_t((unsigned __int128)(g % N) * (T % N) % N);
  }
  const uint64_t S = uint64_t(samples_per_epoch());
  const uint64_t epoch = g / S, k = g % S;
  if (S == 1) return 0;
  int bits = 0;
  while ((uint64_t(1) << bits) < S) ++bits;
  const int half = (bits + 1) / 2;
  const uint64_t key = philox_key(c_.seed, "data_loader.shuffle");
  // With S = 1 the one window may wrap (N <= seq_len); otherwise pi(k) * T + T < N.
  return int64_t(feistel_permute(k, S, half, key, epoch) * T);
}

MicroBatch DataLoader::get(int64_t step, int64_t micro) const {
  LOOM_CHECK(step >= 0, "data loader: step must be >= 0, got ", step);
  LOOM_CHECK(micro >= 0 && micro < c_.grad_accum_steps, "data loader: micro-step ", micro,
             " is outside [0, ", c_.grad_accum_steps, ")");
  MicroBatch mb;
  mb.B = c_.local_batch_size;
  mb.T = c_.seq_len;
  const int64_t B = mb.B, T = mb.T;
  mb.inputs.resize(size_t(B * T));
  mb.targets.resize(size_t(B * T));
  const int64_t G = samples_per_step();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t j = (micro * c_.dp_size + c_.dp_rank) * B + i;
    const uint64_t start = uint64_t(sample_start(step * G + j));
    int32_t* in = mb.inputs.data() + i * T;
    int32_t* tg = mb.targets.data() + i * T;
    // The window is T + 1 tokens: read T into the inputs, and the targets are the same tokens
    // shifted by one plus the one after.
    stream_.read(start, uint64_t(T), in);
    std::copy(in + 1, in + T, tg);
    stream_.read(start + uint64_t(T), 1, tg + T - 1);
  }
  return mb;
}

}  // namespace loom
