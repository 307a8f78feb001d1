#include "data/data_loader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>

#include "core/error.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using loom::DataLoader;
using loom::DataLoaderConfig;
using loom::MicroBatch;
using loom::TokenStream;

namespace {

// A dataset directory whose train split holds `tokens` cut into shards of the given sizes (the
// last shard takes the rest), so that windows cross shard boundaries.
struct Dataset {
  fs::path dir;
  std::vector<int32_t> tokens;
  std::unique_ptr<TokenStream> stream;
  Dataset(std::vector<int32_t> toks, uint64_t vocab, const std::vector<size_t>& sizes = {}) {
    tokens = std::move(toks);
    dir = fs::temp_directory_path() /
          loom::str_cat("loom_loader_test_", ::getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    size_t at = 0;
    int k = 0;
    auto put = [&](size_t n) {
      char name[32];
      std::snprintf(name, sizeof name, "train-%05d.bin", k++);
      loom::write_shard((dir / name).string(), tokens.data() + at, n, vocab);
      at += n;
    };
    for (size_t n : sizes) put(n);
    put(tokens.size() - at);
    stream = std::make_unique<TokenStream>(dir.string(), "train");
  }
  ~Dataset() { fs::remove_all(dir); }
};

// Token i is id i: a window's first input is its start.
std::vector<int32_t> iota_tokens(size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::vector<int32_t> random_tokens(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

DataLoaderConfig config(int64_t B, int64_t T, int64_t accum, int64_t dp, int64_t rank,
                        bool shuffle = false, uint64_t seed = 0) {
  DataLoaderConfig c;
  c.local_batch_size = B;
  c.seq_len = T;
  c.grad_accum_steps = accum;
  c.dp_size = dp;
  c.dp_rank = rank;
  c.shuffle = shuffle;
  c.seed = seed;
  return c;
}

using loom::test::expect_error;

// The epoch-e order of a shuffled loader: the start of each of its S samples.
std::vector<int64_t> epoch_starts(const TokenStream& s, int64_t T, uint64_t seed, int64_t epoch) {
  DataLoader one(s, config(1, T, 1, 1, 0, true, seed));
  const int64_t S = one.samples_per_epoch();
  std::vector<int64_t> starts;
  for (int64_t k = 0; k < S; ++k) starts.push_back(one.get(epoch * S + k, 0).inputs[0]);
  return starts;
}

}  // namespace

// Decision 11 written out: sample j of step s starts at token (s*G + j) * T of the stream,
// wrapping; inputs are its first T tokens, targets its last T.
TEST(DataLoader, SequentialSamplesFollowTheSpecification) {
  const int64_t N = 1000, T = 7, B = 3, accum = 2;
  Dataset d(random_tokens(N, 5000, 7), 5000, {300, 1, 0});
  DataLoader loader(*d.stream, config(B, T, accum, 1, 0));
  const int64_t G = B * accum;
  EXPECT_EQ(loader.samples_per_step(), G);
  EXPECT_EQ(loader.samples_per_epoch(), (N - 1) / T);
  // 60 steps cover 60*6*7 = 2520 tokens: the stream wraps twice, mid-window.
  for (int64_t s = 0; s < 60; ++s)
    for (int64_t m = 0; m < accum; ++m) {
      const MicroBatch mb = loader.get(s, m);
      ASSERT_EQ(mb.B, B);
      ASSERT_EQ(mb.T, T);
      for (int64_t i = 0; i < B; ++i) {
        const int64_t j = m * B + i, start = (s * G + j) * T;
        for (int64_t t = 0; t < T; ++t) {
          ASSERT_EQ(mb.inputs[i * T + t], d.tokens[(start + t) % N]) << s << " " << j << " " << t;
          ASSERT_EQ(mb.targets[i * T + t], d.tokens[(start + t + 1) % N]);
        }
      }
    }
  // Far steps: the token offset (s*G + j) * T is reduced without overflow.
  const int64_t far = int64_t(1) << 58;
  const MicroBatch mb = loader.get(far, 1);
  const unsigned __int128 start = (unsigned __int128)(far * G + B) * T;
  EXPECT_EQ(mb.inputs[0], d.tokens[size_t(start % N)]);
}

TEST(DataLoader, EveryLayoutSeesTheSingleRankBatch) {
  const int64_t G = 16, T = 5, N = 523;  // N - 1 not a multiple of T: windows wrap mid-stream
  Dataset d(random_tokens(N, 300, 11), 300, {100, 200});
  for (bool shuffle : {false, true}) {
    DataLoader single(*d.stream, config(G, T, 1, 1, 0, shuffle, 99));
    for (int64_t dp : {1, 2, 4})
      for (int64_t accum : {1, 2, 4}) {
        const int64_t B = G / (dp * accum);
        std::vector<std::unique_ptr<DataLoader>> ranks;
        for (int64_t r = 0; r < dp; ++r)
          ranks.push_back(
              std::make_unique<DataLoader>(*d.stream, config(B, T, accum, dp, r, shuffle, 99)));
        // 14 steps of 16 samples: 224 > 2 * 104 samples per epoch, so epochs turn mid-step.
        for (int64_t s = 0; s < 14; ++s) {
          const MicroBatch ref = single.get(s, 0);
          std::vector<int32_t> inputs, targets;
          for (int64_t m = 0; m < accum; ++m)
            for (int64_t r = 0; r < dp; ++r) {
              const MicroBatch mb = ranks[size_t(r)]->get(s, m);
              ASSERT_EQ(mb.B, B);
              inputs.insert(inputs.end(), mb.inputs.begin(), mb.inputs.end());
              targets.insert(targets.end(), mb.targets.begin(), mb.targets.end());
            }
          ASSERT_EQ(inputs, ref.inputs)
              << "shuffle " << shuffle << " dp " << dp << " accum " << accum << " step " << s;
          ASSERT_EQ(targets, ref.targets);
        }
      }
  }
}

TEST(DataLoader, TargetsAreInputsShiftedByOne) {
  const int64_t N = 301, T = 16;
  Dataset d(iota_tokens(N), N, {150});
  for (bool shuffle : {false, true}) {
    DataLoader loader(*d.stream, config(4, T, 1, 1, 0, shuffle, 5));
    for (int64_t s = 0; s < 10; ++s) {
      const MicroBatch mb = loader.get(s, 0);
      for (int64_t i = 0; i < 4; ++i) {
        for (int64_t t = 0; t + 1 < T; ++t)
          ASSERT_EQ(mb.targets[i * T + t], mb.inputs[i * T + t + 1]);
        // The last target is the token after the window's inputs in the stream.
        ASSERT_EQ(mb.targets[i * T + T - 1], (mb.inputs[i * T + T - 1] + 1) % N);
      }
    }
  }
}

TEST(DataLoader, ShuffleIsASeededPermutationOfEachEpoch) {
  const int64_t T = 9, N = 1000, S = (N - 1) / T;  // 111 windows, none wrapping
  Dataset d(iota_tokens(N), N, {500});
  std::vector<int64_t> expected(S);
  for (int64_t k = 0; k < S; ++k) expected[size_t(k)] = k * T;
  std::vector<std::vector<int64_t>> orders;
  for (int64_t e = 0; e < 3; ++e) {
    auto starts = epoch_starts(*d.stream, T, 42, e);
    EXPECT_EQ(starts, epoch_starts(*d.stream, T, 42, e)) << "not a function of (seed, epoch)";
    EXPECT_NE(starts, expected) << "epoch " << e << " is not shuffled";
    orders.push_back(starts);
    std::sort(starts.begin(), starts.end());
    EXPECT_EQ(starts, expected) << "epoch " << e << " is not a permutation of the windows";
  }
  EXPECT_NE(orders[0], orders[1]);
  EXPECT_NE(orders[1], orders[2]);
  EXPECT_NE(orders[0], epoch_starts(*d.stream, T, 43, 0)) << "the seed changes nothing";
  // Windows of a shuffled epoch never wrap: every input is start + t.
  DataLoader loader(*d.stream, config(7, T, 1, 1, 0, true, 42));
  for (int64_t s = 0; s < 40; ++s) {
    const MicroBatch mb = loader.get(s, 0);
    for (int64_t i = 0; i < 7; ++i)
      for (int64_t t = 0; t < T; ++t) ASSERT_EQ(mb.inputs[i * T + t], mb.inputs[i * T] + t);
  }
}

TEST(DataLoader, ShuffleIsAPermutationForAnyEpochSize) {
  // Small and awkward epoch sizes (domains of 4^h elements cut down by cycle walking).
  for (int64_t S : {1, 2, 3, 4, 5, 7, 16, 17, 63, 64, 65, 257}) {
    const int64_t T = 3, N = S * T + 1 + (S % 3);  // floor((N-1)/T) == S
    Dataset d(iota_tokens(size_t(N)), uint64_t(N));
    DataLoader loader(*d.stream, config(1, T, 1, 1, 0, true, 7));
    ASSERT_EQ(loader.samples_per_epoch(), S);
    for (int64_t e = 0; e < 2; ++e) {
      auto starts = epoch_starts(*d.stream, T, 7, e);
      std::sort(starts.begin(), starts.end());
      for (int64_t k = 0; k < S; ++k) ASSERT_EQ(starts[size_t(k)], k * T) << "S " << S;
    }
  }
}

TEST(DataLoader, ShuffleIsUniform) {
  // Where sample 0 of epoch 0 lands over 2000 seeds, and over 2000 epochs of one seed: each of
  // the 10 windows expects 200 (sd 13.4); [140, 260] fails a biased permutation (an identity or
  // a fixed-point-heavy one would put ~2000 in one bin), and a fair one with p < 1e-5.
  const int64_t T = 2, S = 10, N = S * T + 1;
  Dataset d(iota_tokens(N), N);
  std::vector<int> by_seed(S), by_epoch(S);
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    DataLoader loader(*d.stream, config(1, T, 1, 1, 0, true, seed));
    by_seed[size_t(loader.get(0, 0).inputs[0] / T)]++;
  }
  DataLoader loader(*d.stream, config(1, T, 1, 1, 0, true, 3));
  for (int64_t e = 0; e < 2000; ++e) by_epoch[size_t(loader.get(e * S, 0).inputs[0] / T)]++;
  for (int64_t k = 0; k < S; ++k) {
    EXPECT_GE(by_seed[size_t(k)], 140) << k;
    EXPECT_LE(by_seed[size_t(k)], 260) << k;
    EXPECT_GE(by_epoch[size_t(k)], 140) << k;
    EXPECT_LE(by_epoch[size_t(k)], 260) << k;
  }
}

TEST(DataLoader, StreamShorterThanAWindowWraps) {
  const int64_t N = 4, T = 6;
  Dataset d(random_tokens(N, 50, 3), 50, {1});
  for (bool shuffle : {false, true}) {
    DataLoader loader(*d.stream, config(2, T, 1, 1, 0, shuffle, 1));
    EXPECT_EQ(loader.samples_per_epoch(), 1);
    for (int64_t s = 0; s < 3; ++s) {
      const MicroBatch mb = loader.get(s, 0);
      for (int64_t i = 0; i < 2; ++i) {
        const int64_t start = shuffle ? 0 : (s * 2 + i) * T;
        for (int64_t t = 0; t < T; ++t) {
          ASSERT_EQ(mb.inputs[i * T + t], d.tokens[(start + t) % N]);
          ASSERT_EQ(mb.targets[i * T + t], d.tokens[(start + t + 1) % N]);
        }
      }
    }
  }
}

TEST(DataLoader, RejectsBadConfigurations) {
  Dataset d(iota_tokens(100), 100);
  expect_error([&] { DataLoader l(*d.stream, config(1, 4, 1, 2, 2)); }, {"dp_rank 2", "[0, 2)"});
  expect_error([&] { DataLoader l(*d.stream, config(1, 0, 1, 1, 0)); }, {"seq_len", "got 0"});
  expect_error([&] { DataLoader l(*d.stream, config(0, 4, 1, 1, 0)); }, {"local_batch_size"});
  expect_error([&] { DataLoader l(*d.stream, config(1, 4, 0, 1, 0)); }, {"grad_accum_steps"});
  DataLoader l(*d.stream, config(1, 4, 3, 1, 0));
  expect_error([&] { l.get(0, 3); }, {"micro-step 3", "[0, 3)"});
  expect_error([&] { l.get(-1, 0); }, {"step", "-1"});
}
