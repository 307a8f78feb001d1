// The test utility tests/support/thread_process_group.hpp: every collective over 3 thread-ranks
// against what each rank must receive, point-to-point matching in send and post order, split,
// the log of issues and waits, and a rank issuing another collective than its peers failing
// the run instead of hanging it.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/support/thread_process_group.hpp"

namespace loom {
namespace {

using dist::ReduceOp;
using test::run_ranks;
using test::ThreadProcessGroup;

Tensor filled(std::vector<float> v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::f32);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

TEST(ThreadProcessGroup, CollectivesGiveEachRankItsResult) {
  constexpr int n = 3;
  std::vector<std::vector<std::vector<float>>> got(n);
  run_ranks(n, [&](ThreadProcessGroup& g) {
    const float r = float(g.rank());
    auto& out = got[size_t(g.rank())];
    // Issued together, waited in reverse: a Work completes when waited, whatever the order.
    Tensor in = filled({r, 10 + r});
    Tensor gathered = Tensor::empty({2 * n}, DType::f32);
    Tensor rs_in = filled({r, 2 * r, 3 * r, 4 * r, 5 * r, 6 * r});
    Tensor rs_out = Tensor::empty({2}, DType::f32);
    Tensor ar = filled({r + 1, 1});
    Tensor bc = filled({r, r});
    Tensor a2a_in = filled({10 * r, 10 * r + 1, 10 * r + 2});
    Tensor a2a_out = Tensor::empty({3}, DType::f32);
    auto w1 = g.all_gather(in, gathered);
    auto w2 = g.reduce_scatter(rs_in, rs_out, ReduceOp::sum);
    auto w3 = g.all_reduce(ar, ReduceOp::avg);
    auto w4 = g.broadcast(bc, 2);
    auto w5 = g.all_to_all(a2a_in, a2a_out);
    EXPECT_FALSE(w1->test());  // never before its wait: completion follows the program
    for (auto* w : {&w5, &w4, &w3, &w2, &w1}) (*w)->wait();
    EXPECT_TRUE(w1->test());
    for (const Tensor* t : {&gathered, &rs_out, &ar, &bc, &a2a_out}) out.push_back(values(*t));
    g.barrier()->wait();
  });
  for (int r = 0; r < n; ++r) {
    const auto& out = got[size_t(r)];
    const float fr = float(r);
    EXPECT_EQ(out[0], (std::vector<float>{0, 10, 1, 11, 2, 12})) << r;
    // Block r of sum_k (k, 2k, ..., 6k) = (1+2)(2r+1, 2r+2)... = 3 * (2r+1, 2r+2).
    EXPECT_EQ(out[1], (std::vector<float>{3 * (2 * fr + 1), 3 * (2 * fr + 2)})) << r;
    EXPECT_EQ(out[2], (std::vector<float>{2, 1})) << r;  // avg of 1, 2, 3 and of 1, 1, 1
    EXPECT_EQ(out[3], (std::vector<float>{2, 2})) << r;
    EXPECT_EQ(out[4], (std::vector<float>{fr, 10 + fr, 20 + fr})) << r;
  }
}

// Row i of what rank `from` sends rank `to`, element e: distinct for every (from, to, i, e) and
// exact in every dtype (integers below 256 in bf16).
double a2av_value(int from, int to, int64_t i, int64_t e) {
  return double((from * 61 + to * 17 + i * 5 + e * 3) % 251 - 125);
}

void a2av_set(const Tensor& t, int64_t k, double v) {
  if (t.dtype() == DType::f32) t.data<float>()[k] = float(v);
  if (t.dtype() == DType::bf16) t.data<bf16>()[k] = float_to_bf16(float(v));
  if (t.dtype() == DType::i32) t.data<int32_t>()[k] = int32_t(v);
}

double a2av_get(const Tensor& t, int64_t k) {
  if (t.dtype() == DType::f32) return t.data<float>()[k];
  if (t.dtype() == DType::bf16) return bf16_to_float(t.data<bf16>()[k]);
  return t.data<int32_t>()[k];
}

TEST(ThreadProcessGroup, AllToAllVMovesEveryRowToItsRank) {
  constexpr int n = 4;
  constexpr int64_t width = 3;
  for (DType d : {DType::f32, DType::bf16, DType::i32}) {
    for (int trial = 0; trial < 3; ++trial) {
      SCOPED_TRACE(str_cat(dtype_name(d), " trial ", trial));
      // rows[from][to], random with zeros (trial 2: rank 3 sends nothing and rank 0 gets nothing).
      std::mt19937 rng(uint32_t(17 + trial));
      std::uniform_int_distribution<int> count(-2, 5);
      int64_t rows[n][n];
      for (int f = 0; f < n; ++f)
        for (int t = 0; t < n; ++t)
          rows[f][t] = trial == 2 && (f == 3 || t == 0) ? 0 : std::max(0, count(rng));
      std::vector<uint64_t> bytes(n);
      run_ranks(n, [&](ThreadProcessGroup& g) {
        const int r = g.rank();
        std::vector<int64_t> send(n), recv(n);
        int64_t in_rows = 0, out_rows = 0;
        for (int q = 0; q < n; ++q) {
          send[size_t(q)] = rows[r][q], recv[size_t(q)] = rows[q][r];
          in_rows += rows[r][q], out_rows += rows[q][r];
        }
        Tensor in = Tensor::empty({in_rows, width}, d), out = Tensor::empty({out_rows, width}, d);
        for (int64_t k = 0, q = 0; q < n; ++q)
          for (int64_t i = 0; i < rows[r][q]; ++i)
            for (int64_t e = 0; e < width; ++e) a2av_set(in, k++, a2av_value(r, int(q), i, e));
        for (int64_t k = 0; k < out.numel(); ++k) a2av_set(out, k, -200);
        g.all_to_all_v(in, send, out, recv)->wait();
        for (int64_t k = 0, q = 0; q < n; ++q)
          for (int64_t i = 0; i < rows[q][r]; ++i)
            for (int64_t e = 0; e < width; ++e, ++k)
              ASSERT_EQ(a2av_get(out, k), a2av_value(int(q), r, i, e))
                  << "rank " << r << " from " << q << " row " << i;
        bytes[size_t(r)] = g.counters().bytes_sent;
      });
      for (int r = 0; r < n; ++r) {
        int64_t to_others = 0;
        for (int q = 0; q < n; ++q) to_others += q == r ? 0 : rows[r][q];
        EXPECT_EQ(bytes[size_t(r)], uint64_t(to_others * width) * dtype_size(d)) << r;
      }
    }
  }
}

TEST(ThreadProcessGroup, AllToAllVNamesACountThatIsNotTheSenders) {
  // Rank 0 sends rank 1 two rows; rank 1 expects three from it.
  try {
    run_ranks(
        2,
        [&](ThreadProcessGroup& g) {
          const std::vector<int64_t> send =
              g.rank() == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 1};
          const std::vector<int64_t> recv =
              g.rank() == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{3, 1};
          Tensor in = Tensor::zeros({send[0] + send[1], 2}, DType::f32);
          Tensor out = Tensor::zeros({recv[0] + recv[1], 2}, DType::f32);
          g.all_to_all_v(in, send, out, recv)->wait();
        },
        /*timeout_s=*/5);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_to_all_v on group 'world'"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0 sends 2 rows to rank 1 but rank 1 expects recv_rows[0] = 3"),
              std::string::npos)
        << what;
  }
}

TEST(ThreadProcessGroup, Bf16SumRoundsAfterEachAdditionInRankOrder) {
  // 1 + 2^-8 + 2^-8 in bf16 (8 significant bits): (1 + 2^-8) rounds to 1 (ties to even), and so
  // does the next addition; the exact sum 1 + 2^-7 would be representable.
  std::vector<float> got(3);
  run_ranks(3, [&](ThreadProcessGroup& g) {
    Tensor t = Tensor::empty({1}, DType::bf16);
    t.data<bf16>()[0] = float_to_bf16(g.rank() == 0 ? 1.0f : 1.0f / 256);
    g.all_reduce(t, ReduceOp::sum)->wait();
    got[size_t(g.rank())] = bf16_to_float(t.data<bf16>()[0]);
  });
  EXPECT_EQ(got, std::vector<float>(3, 1.0f));
}

TEST(ThreadProcessGroup, RecvsMatchSendsInOrderPerPeerAndTag) {
  std::vector<float> got;
  run_ranks(2, [&](ThreadProcessGroup& g) {
    if (g.rank() == 0) {
      // Posted before the sends; the second of tag 5 waited first.
      Tensor a = Tensor::empty({1}, DType::f32), b = Tensor::empty({1}, DType::f32);
      Tensor c = Tensor::empty({1}, DType::f32);
      auto wa = g.recv(a, 1, 5);
      auto wb = g.recv(b, 1, 5);
      auto wc = g.recv(c, 1, 7);
      wb->wait();
      wc->wait();
      wa->wait();
      got = {a.data<float>()[0], b.data<float>()[0], c.data<float>()[0]};
    } else {
      g.send(filled({7}), 0, 7)->wait();
      g.send(filled({1}), 0, 5)->wait();
      g.send(filled({2}), 0, 5)->wait();
    }
  });
  EXPECT_EQ(got, (std::vector<float>{1, 2, 7}));
}

TEST(ThreadProcessGroup, SplitOrdersByKeyAndLogsInProgramOrder) {
  std::vector<std::vector<int>> members(4);
  std::vector<float> sums(4);
  std::vector<std::vector<std::string>> logs(4);
  run_ranks(4, [&](ThreadProcessGroup& g) {
    // Colors 0 (ranks 0, 2) and 1 (ranks 1, 3), keys reversing the order.
    auto sub = g.split(g.rank() % 2, -g.rank(), "half");
    members[size_t(g.rank())] = sub->world_ranks();
    Tensor t = filled({float(g.rank())});
    sub->all_reduce(t, ReduceOp::sum)->wait();
    sums[size_t(g.rank())] = t.data<float>()[0];
    logs[size_t(g.rank())] = static_cast<ThreadProcessGroup&>(*sub).log();
  });
  EXPECT_EQ(members[0], (std::vector<int>{2, 0}));
  EXPECT_EQ(members[1], (std::vector<int>{3, 1}));
  EXPECT_EQ(sums, (std::vector<float>{2, 4, 2, 4}));
  EXPECT_EQ(logs[3], (std::vector<std::string>{"all_reduce#0 issue", "all_reduce#0 wait"}));
}

TEST(ThreadProcessGroup, MismatchedCollectivesFailTheRun) {
  // Rank 1 all-reduces where rank 0 broadcasts: an error naming both, not a hang.
  try {
    run_ranks(
        2,
        [&](ThreadProcessGroup& g) {
          Tensor t = filled({1});
          if (g.rank() == 0)
            g.broadcast(t, 0)->wait();
          else
            g.all_reduce(t, ReduceOp::sum)->wait();
        },
        /*timeout_s=*/5);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("issued"), std::string::npos) << what;
  }
  // A rank that never arrives: the wait times out.
  EXPECT_THROW(run_ranks(
                   2,
                   [&](ThreadProcessGroup& g) {
                     if (g.rank() == 0) g.barrier()->wait();
                   },
                   /*timeout_s=*/0.2),
               Error);
}

}  // namespace
}  // namespace loom
