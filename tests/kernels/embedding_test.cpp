#include "kernels/cpu/embedding.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

struct Shape {
  int64_t n, vocab, dim;
};

}  // namespace

TEST_ALL_ISAS(Embedding, ForwardGathersRows) {
  for (auto [n, vocab, dim] : std::vector<Shape>{{37, 50, 288}, {2048, 301, 50}, {5, 7, 513}}) {
    auto table = test::randn(static_cast<size_t>(vocab * dim), 3);
    auto tok = test::random_tokens(n, vocab, 4);
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
TEST_ALL_ISAS(Embedding, BackwardAccumulatesDeterministically) {
  for (auto [n, vocab, dim] : std::vector<Shape>{{37, 50, 288}, {2048, 301, 50}, {513, 7, 513}}) {
    auto dout = test::randn(static_cast<size_t>(n * dim), 5);
    auto tok = test::random_tokens(n, vocab, 6);
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
TEST_ALL_ISAS(Embedding, BackwardMatchesFiniteDifferences) {
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
