// parallel/layers/context_parallel: the zigzag layout and the positions of a micro-batch.
#include "parallel/layers/context_parallel.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/cpu/attention_block.hpp"
#include "tests/test_util.hpp"

namespace loom {
namespace {

// Load balance: the causal score entries each cp rank computes (its queries against all keys)
// are equal within 1% (the zigzag layout makes them exactly equal).
TEST(ContextParallel, CpRanksComputeEqualAttentionWork) {
  for (int64_t cp : {2, 4, 8})
    for (int64_t T : {256, 1024, 4096}) {
      std::vector<std::vector<int64_t>> pos;
      for (int64_t r = 0; r < cp; ++r) pos.push_back(cp_positions(T, cp, r));
      const int64_t n = T / cp;
      int64_t lo = INT64_MAX, hi = 0, total = 0;
      for (int64_t r = 0; r < cp; ++r) {
        int64_t w = 0;
        for (int64_t s = 0; s < cp; ++s)
          w += cpu::causal_entries(pos[r].data(), n, pos[s].data(), n);
        lo = std::min(lo, w);
        hi = std::max(hi, w);
        total += w;
      }
      EXPECT_EQ(total, T * (T + 1) / 2) << "cp=" << cp << " T=" << T;
      EXPECT_LE(double(hi - lo), 0.01 * double(hi)) << "cp=" << cp << " T=" << T;
    }
  // The naive layout (rank r holds the r-th contiguous T/cp tokens) fails this check: the test
  // can tell a balanced layout from an unbalanced one.
  const int64_t T = 1024, cp = 4, n = T / cp;
  std::vector<int64_t> first(n), last(n), all(T);
  for (int64_t t = 0; t < n; ++t) first[t] = t, last[t] = T - n + t;
  for (int64_t t = 0; t < T; ++t) all[t] = t;
  EXPECT_GT(cpu::causal_entries(last.data(), n, all.data(), T),
            2 * cpu::causal_entries(first.data(), n, all.data(), T));
}

TEST(ContextParallel, SequenceNotDivisibleIsAnError) {
  test::expect_error([] { cp_positions(30, 4, 0); }, {"30", "2*cp", "8"});
  test::expect_error([] { cp_positions(24, 2, 1, 4); }, {"24", "2*cp*tp", "16"});
  EXPECT_EQ(cp_positions(8, 2, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(cp_positions(8, 2, 0), (std::vector<int64_t>{0, 1, 6, 7}));
}

TEST(ContextParallel, MicroBatchPositionsWithoutCp) {
  std::vector<int32_t> pos;
  std::vector<std::vector<int64_t>> by_rank{{1}};
  EXPECT_EQ(cp_micro_batch_positions({}, 6, 1, pos, by_rank), 6);
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(by_rank.empty());
}

}  // namespace
}  // namespace loom
