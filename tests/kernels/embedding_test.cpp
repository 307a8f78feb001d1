#include "kernels/cpu/embedding.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// Zipf-like ids with many repeats, so several positions land on the same table row.
std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(double(vocab) * u(rng) * u(rng) * u(rng));
  return t;
}

struct Shape {
  int64_t n, vocab, dim;
};

}  // namespace

TEST(Embedding, ForwardGathersRows) {
  for (auto [n, vocab, dim] : std::vector<Shape>{{37, 50, 288}, {2048, 301, 50}, {5, 7, 513}}) {
    auto table = test::randn(static_cast<size_t>(vocab * dim), 3);
    auto tok = random_tokens(n, vocab, 4);
    std::vector<float> out(static_cast<size_t>(n * dim), -1.0f);
    cpu::embedding_forward(tok.data(), n, table.data(), vocab, dim, out.data());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(&out[i * dim], &table[int64_t(tok[i]) * dim], dim * sizeof(float)), 0)
          << "row " << i;
    }
  }
}

// The kernel must produce the serial loop's bits (contributions to a row in position order, added
// to what dtable held) for any thread count: that is the determinism contract.
TEST(Embedding, BackwardAccumulatesDeterministically) {
  for (auto [n, vocab, dim] : std::vector<Shape>{{37, 50, 288}, {2048, 301, 50}, {513, 7, 513}}) {
    auto dout = test::randn(static_cast<size_t>(n * dim), 5);
    auto tok = random_tokens(n, vocab, 6);
    auto init = test::randn(static_cast<size_t>(vocab * dim), 7);
    auto ref = init;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < dim; ++d) ref[tok[i] * dim + d] += dout[i * dim + d];
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2, 3, 5}) {
      omp_set_num_threads(threads);
      auto dt = init;
      cpu::embedding_backward(tok.data(), n, dout.data(), vocab, dim, dt.data());
      EXPECT_EQ(std::memcmp(dt.data(), ref.data(), ref.size() * sizeof(float)), 0)
          << "threads=" << threads << " n=" << n << " dim=" << dim;
    }
    omp_set_num_threads(saved);
  }
}

// L = sum(out * r) differentiated w.r.t. the table by fp64 central differences. L is linear in the
// table, so the fp64 reference is exact to ~1e-10; 1e-6 catches any missed or doubled row.
TEST(Embedding, BackwardMatchesFiniteDifferences) {
  const int64_t n = 11, vocab = 7, dim = 5;
  std::vector<int32_t> tok = {3, 0, 6, 3, 3, 1, 6, 2, 0, 5, 3};  // id 4 unused: gradient 0
  auto r = test::randn(static_cast<size_t>(n * dim), 8);
  auto table = test::to_double(test::randn(static_cast<size_t>(vocab * dim), 9));
  auto loss = [&](const std::vector<double>& t) {
    double L = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < dim; ++d) L += t[tok[i] * dim + d] * r[i * dim + d];
    return L;
  };
  auto num = test::numeric_grad(loss, table);
  std::vector<float> dt(static_cast<size_t>(vocab * dim), 0.0f);
  cpu::embedding_backward(tok.data(), n, r.data(), vocab, dim, dt.data());
  EXPECT_LT(test::rel_l2(dt, num), 1e-6);
  for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(dt[4 * dim + d], 0.0f);
}

TEST(Embedding, RejectsOutOfRangeTokens) {
  const int64_t vocab = 10, dim = 4;
  std::vector<float> table(vocab * dim, 1.0f), out(3 * dim);
  for (int32_t bad : {10, -1}) {
    std::vector<int32_t> tok = {1, 2, bad};
    try {
      cpu::embedding_forward(tok.data(), 3, table.data(), vocab, dim, out.data());
      FAIL() << "no error for id " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token id " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("vocab size 10"), std::string::npos) << msg;
    }
    EXPECT_THROW(cpu::embedding_backward(tok.data(), 3, out.data(), vocab, dim, table.data()),
                 Error);
  }
  std::vector<int32_t> ok = {0};
  EXPECT_THROW(cpu::embedding_forward(ok.data(), 1, table.data(), vocab, 0, out.data()), Error);
}

// Timing at a training-step size: run with --gtest_also_run_disabled_tests, OMP_NUM_THREADS=2.
TEST(Embedding, DISABLED_Bench) {
  const int64_t n = 2048, dim = 512, vocab = 8192;
  auto table = test::randn(static_cast<size_t>(vocab * dim), 1);
  auto tok = random_tokens(n, vocab, 2);
  std::vector<float> out(static_cast<size_t>(n * dim)), dt(static_cast<size_t>(vocab * dim), 0.0f);
  // Best of 200 runs: the build machine is shared, and the minimum is the least disturbed.
  auto time = [](auto&& f) {
    f();
    double best = 1e30;
    for (int i = 0; i < 200; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      f();
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const double bytes = double(n * dim) * 4;
  double t =
      time([&] { cpu::embedding_forward(tok.data(), n, table.data(), vocab, dim, out.data()); });
  std::printf("embedding_forward  n=%ld dim=%ld: %.1f us, %.1f GB/s (read+write)\n", n, dim,
              t * 1e6, 2 * bytes / t / 1e9);
  t = time([&] { cpu::embedding_backward(tok.data(), n, out.data(), vocab, dim, dt.data()); });
  std::printf("embedding_backward n=%ld dim=%ld: %.1f us, %.1f GB/s (dout + row read/write)\n", n,
              dim, t * 1e6, 3 * bytes / t / 1e9);
}
