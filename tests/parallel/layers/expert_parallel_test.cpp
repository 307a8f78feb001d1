// parallel/layers/expert_parallel: the rows of each rank's tokens reach the ranks that hold their
// experts, grouped by local expert in rank order, come back to where they were, and the bytes sent
// are the analytic figure (the rows for other ranks' experts).
#include "parallel/layers/expert_parallel.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "distributed/sim_process_group.hpp"
#include "tests/support/thread_process_group.hpp"

namespace loom {
namespace {

// Rank r's rows sorted by expert, with `counts[r][e]` rows for expert e; row values encode
// (rank, expert, index, column) so that where each row lands can be checked.
float value(int rank, int64_t expert, int64_t i, int64_t col) {
  return float(rank * 1000000 + expert * 10000 + i * 10 + col);
}

// The value as a tensor of `dt` holds it.
float as(DType dt, float v) {
  return dt == DType::bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

TEST(ExpertParallel, RowsReachTheirExpertsAndComeBack) {
  const int n = 4;
  const int64_t E = 8, El = E / n, W = 3;
  std::mt19937 rng(5);
  std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(static_cast<size_t>(E)));
  for (auto& c : counts)
    for (auto& x : c) x = int64_t(rng() % 5);  // zeros included
  counts[1][5] = 0;                            // an expert a rank sends nothing to
  for (DType dt : {DType::f32, DType::bf16}) {
    test::run_ranks(n, [&](test::ThreadProcessGroup& g) {
      const int me = g.rank();
      const std::vector<int64_t>& mine = counts[size_t(me)];
      const int64_t N = std::accumulate(mine.begin(), mine.end(), int64_t(0));
      Tensor rows = Tensor::empty({N, W}, DType::f32);
      int64_t at = 0;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < mine[size_t(e)]; ++i, ++at)
          for (int64_t c = 0; c < W; ++c) rows.data<float>()[at * W + c] = value(me, e, i, c);
      const Tensor in = rows.to(dt);
      g.reset_counters();
      const ExpertExchange x = expert_exchange(g, mine, Device::cpu);
      const Tensor local = expert_dispatch(g, x, in);
      // Grouped by local expert, each expert's rows rank by rank, in their order there.
      ASSERT_EQ(local.size(0), x.rows());
      const Tensor lf = local.to(DType::f32);
      int64_t r = 0;
      for (int64_t e = 0; e < El; ++e) {
        const int64_t global = me * El + e;
        int64_t expert_rows = 0;
        for (int src = 0; src < n; ++src)
          for (int64_t i = 0; i < counts[size_t(src)][size_t(global)]; ++i, ++r, ++expert_rows)
            for (int64_t c = 0; c < W; ++c)
              ASSERT_EQ(lf.data<float>()[r * W + c], as(dt, value(src, global, i, c)))
                  << "rank " << me << " row " << r;
        EXPECT_EQ(x.local_counts[size_t(e)], expert_rows);
      }
      // Back where they came from: the same bits.
      const Tensor back = expert_combine(g, x, local);
      ASSERT_EQ(back.size(0), N);
      EXPECT_EQ(std::memcmp(back.to(DType::f32).data<float>(), in.to(DType::f32).data<float>(),
                            size_t(N * W) * 4),
                0);
      // Bytes: the counts' all-to-all ((n - 1) / n of E int32) and each exchange's rows for (and
      // from) the other ranks.
      int64_t to_others = 0, from_others = 0;
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        to_others += x.send_rows[size_t(j)];
        from_others += x.recv_rows[size_t(j)];
      }
      const uint64_t row = uint64_t(W) * dtype_size(dt);
      const uint64_t want =
          uint64_t((n - 1) * E * 4 / n) + uint64_t(to_others) * row + uint64_t(from_others) * row;
      EXPECT_EQ(g.counters().bytes_sent, want) << "rank " << me;
    });
  }
}

// On meta (the planner) nothing is routed: the exchange takes every rank to send this one what it
// sends itself, the balanced counts as they come, or under PlannedExpertLoad(L) L x N / ep of
// every rank's N rows (its own included), the rest over the other ranks' experts.
TEST(ExpertParallel, PlannedLoadSkewsTheMetaExchange) {
  const int n = 4, me = 1;
  const int64_t E = 8, N = 32;
  dist::SimProcessGroup ep("ep", me, {0, 1, 2, 3}, std::make_shared<dist::SimLog>());
  const std::vector<int64_t> counts(size_t(E), N / E);
  auto check = [&](int64_t hot) {
    const ExpertExchange x = expert_exchange(ep, counts, Device::meta);
    EXPECT_EQ(x.rows(), n * hot);
    EXPECT_EQ(x.local_counts, std::vector<int64_t>(2, n * hot / 2));
    EXPECT_EQ(x.recv_rows, std::vector<int64_t>(size_t(n), hot));
    EXPECT_EQ(x.send_rows[size_t(me)], hot);
    EXPECT_EQ(std::accumulate(x.send_rows.begin(), x.send_rows.end(), int64_t(0)), N);
    EXPECT_EQ(x.to_local.numel(), n * hot);
  };
  check(N / n);  // balanced
  {
    const PlannedExpertLoad twice(2);
    check(2 * N / n);
    {
      const PlannedExpertLoad all(4);  // every row on this rank's experts
      check(N);
      // The rest of each rank's rows spread over the other ranks' experts: none left here.
      EXPECT_EQ(expert_exchange(ep, counts, Device::meta).send_rows,
                std::vector<int64_t>({0, N, 0, 0}));
    }
    check(2 * N / n);  // the enclosing load again
  }
  check(N / n);
  EXPECT_THROW(PlannedExpertLoad(0.5), Error);
}

}  // namespace
}  // namespace loom
