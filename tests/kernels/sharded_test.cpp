// The loops of the sharded layers (kernels/cpu/sharded.hpp) against naive references on random
// inputs.
#include "kernels/cpu/sharded.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/test_util.hpp"

using namespace loom;

TEST(Sharded, CopyRowsBetweenStridedViews) {
  const int64_t rows = 67, width = 24, ss = 40, ds = 31;
  auto src = test::randn(size_t(rows * ss), 1);
  auto dst = test::randn(size_t(rows * ds), 2);
  auto want = dst;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < width; ++i) want[size_t(m * ds + i)] = src[size_t(m * ss + 8 + i)];
  cpu::copy_rows(src.data() + 8, ss, dst.data(), ds, rows, width);
  EXPECT_EQ(dst, want);
  EXPECT_THROW(cpu::copy_rows(src.data(), 10, dst.data(), ds, rows, width), Error);
}

TEST(Sharded, Fill) {
  auto x = test::randn(1000, 3);
  cpu::fill(x.data() + 10, 900, -2.5f);
  for (size_t i = 10; i < 910; ++i) ASSERT_EQ(x[i], -2.5f) << i;
}

TEST(Sharded, EmbeddingRangeForwardAndBackward) {
  const int64_t n = 300, vocab = 41, dim = 19, v0 = 40, rows = 41;  // a table of rows [40, 81)
  const auto tok = test::random_tokens(n, 100, 4);
  const auto table = test::randn(size_t(rows * dim), 5);
  std::vector<float> out = test::randn(size_t(n * dim), 6);
  cpu::embedding_forward_range(tok.data(), n, table.data(), v0, rows, dim, out.data());
  for (int64_t m = 0; m < n; ++m)
    for (int64_t i = 0; i < dim; ++i) {
      const int64_t t = tok[size_t(m)] - v0;
      const float want = t >= 0 && t < rows ? table[size_t(t * dim + i)] : 0.0f;
      ASSERT_EQ(out[size_t(m * dim + i)], want) << m;
    }
  const auto dout = test::randn(size_t(n * dim), 7);
  auto dtable = test::randn(size_t(vocab * dim), 8);
  auto want = dtable;
  for (int64_t m = 0; m < n; ++m) {
    const int64_t t = tok[size_t(m)] - v0;
    if (t < 0 || t >= rows) continue;
    for (int64_t i = 0; i < dim; ++i) want[size_t(t * dim + i)] += dout[size_t(m * dim + i)];
  }
  cpu::embedding_backward_range(tok.data(), n, dout.data(), v0, rows, dim, dtable.data());
  EXPECT_EQ(dtable, want);
}

// Split over n ranks, the three pieces give the single-rank softmax cross-entropy and its
// gradient (fp64 reference), with a padded vocabulary and ignored rows.
TEST(Sharded, VocabShardSoftmaxEqualsTheWholeVocabulary) {
  const int n = 3;
  const int64_t N = 29, vocab = 50, V = 17;  // 3 * 17 = 51: one padding column on rank 2
  auto logits = test::randn(size_t(N * vocab), 9, 3.0f);
  std::vector<int32_t> tg = test::random_tokens(N, vocab, 10);
  tg[3] = -1;
  std::vector<double> ref_lse(static_cast<size_t>(N));
  double ref_loss = 0;
  for (int64_t i = 0; i < N; ++i) {
    double mx = -INFINITY, s = 0;
    for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, double(logits[size_t(i * vocab + v)]));
    for (int64_t v = 0; v < vocab; ++v) s += std::exp(double(logits[size_t(i * vocab + v)]) - mx);
    ref_lse[size_t(i)] = mx + std::log(s);
    if (tg[size_t(i)] >= 0)
      ref_loss += ref_lse[size_t(i)] - logits[size_t(i * vocab + tg[size_t(i)])];
  }
  std::vector<std::vector<float>> part(n, std::vector<float>(size_t(N * V)));
  std::vector<float> lse_all(size_t(n * N)), tsum(size_t(N), 0.0f);
  for (int r = 0; r < n; ++r) {
    const int64_t v0 = r * V, Vr = std::clamp<int64_t>(vocab - v0, 0, V);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t v = 0; v < V; ++v)
        part[r][size_t(i * V + v)] = v < Vr ? logits[size_t(i * vocab + v0 + v)] : 7.0f;
    std::vector<float> t(static_cast<size_t>(N));
    cpu::vocab_shard_lse(part[r].data(), N, V, Vr, tg.data(), v0, lse_all.data() + r * N, t.data());
    for (int64_t i = 0; i < N; ++i) tsum[size_t(i)] += t[size_t(i)];
  }
  std::vector<float> glse(static_cast<size_t>(N));
  const double loss =
      cpu::vocab_shard_combine(lse_all.data(), n, N, tg.data(), tsum.data(), glse.data());
  EXPECT_NEAR(loss, ref_loss, 1e-4 * std::abs(ref_loss));
  for (int64_t i = 0; i < N; ++i) EXPECT_NEAR(glse[size_t(i)], ref_lse[size_t(i)], 1e-4);
  const float scale = 0.25f;
  for (int r = 0; r < n; ++r) {
    const int64_t v0 = r * V, Vr = std::clamp<int64_t>(vocab - v0, 0, V);
    cpu::vocab_shard_dlogits(part[r].data(), N, V, Vr, tg.data(), v0, glse.data(), scale);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t v = 0; v < V; ++v) {
        double want = 0;
        if (tg[size_t(i)] >= 0 && v < Vr) {
          want = std::exp(double(logits[size_t(i * vocab + v0 + v)]) - ref_lse[size_t(i)]) * scale;
          if (v0 + v == tg[size_t(i)]) want -= scale;
        }
        ASSERT_NEAR(part[r][size_t(i * V + v)], want, 1e-5) << r << " " << i << " " << v;
      }
  }
}
