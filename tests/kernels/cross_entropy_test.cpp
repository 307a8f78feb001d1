#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "tests/test_util.hpp"

namespace loom::cpu {
namespace {

using test::randn;
using test::rel_l2;

// Naive fp64 logits of row i, z = x_i W^T, into z; returns their log-sum-exp.
double ref_logits(const std::vector<double>& x, const std::vector<double>& w, int64_t i, int64_t D,
                  int64_t V, std::vector<double>& z) {
  z.assign(V, 0);
  double m = -INFINITY;
  for (int64_t v = 0; v < V; ++v) {
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += x[i * D + d] * w[v * D + d];
    z[v] = s;
    m = std::max(m, s);
  }
  double se = 0;
  for (int64_t v = 0; v < V; ++v) se += std::exp(z[v] - m);
  return m + std::log(se);
}

// Naive fp64 reference: sum over rows with target >= 0 of logsumexp(x_i W^T) - (x_i W^T)[t_i].
double ref_loss(const std::vector<double>& x, const std::vector<double>& w,
                const std::vector<int32_t>& t, int64_t N, int64_t D, int64_t V) {
  double loss = 0;
  std::vector<double> z;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] < 0) continue;
    loss += ref_logits(x, w, i, D, V, z) - z[t[i]];
  }
  return loss;
}

// Analytic fp64 gradients of scale * ref_loss (softmax - onehot), for the larger shapes where
// finite differences would be slow; they are themselves checked against finite differences below.
void ref_grads(const std::vector<double>& x, const std::vector<double>& w,
               const std::vector<int32_t>& t, int64_t N, int64_t D, int64_t V, double scale,
               std::vector<double>& dx, std::vector<double>& dw) {
  dx.assign(N * D, 0);
  dw.assign(V * D, 0);
  std::vector<double> z;
  for (int64_t i = 0; i < N; ++i) {
    if (t[i] < 0) continue;
    const double lse = ref_logits(x, w, i, D, V, z);
    for (int64_t v = 0; v < V; ++v) {
      const double g = scale * (std::exp(z[v] - lse) - (v == t[i] ? 1.0 : 0.0));
      for (int64_t d = 0; d < D; ++d) {
        dx[i * D + d] += g * w[v * D + d];
        dw[v * D + d] += g * x[i * D + d];
      }
    }
  }
}

struct Problem {
  int64_t N, D, V;
  std::vector<float> x, w;
  std::vector<int32_t> t;
  float scale = 1;
  Problem(int64_t n, int64_t d, int64_t v, uint64_t seed) : N(n), D(d), V(v) {
    x = randn(N * D, seed);
    w = randn(V * D, seed + 1, 0.5f);
    std::mt19937 rng(seed + 2);
    t.resize(N);
    int count = 0;
    for (int64_t i = 0; i < N; ++i) {
      t[i] = static_cast<int32_t>(rng() % V);
      if (i % 5 == 3) t[i] = -1;  // some rows ignored
      count += t[i] >= 0;
    }
    t[0] = static_cast<int32_t>(V - 1);  // the last vocabulary entry is a target
    scale = 1.0f / static_cast<float>(count);
  }
  std::vector<double> xd() const { return {x.begin(), x.end()}; }
  std::vector<double> wd() const { return {w.begin(), w.end()}; }
};

struct Result {
  double loss;
  std::vector<float> dx, dw;
};

Result run(const Problem& p, int64_t chunk, std::vector<float> dw0 = {}) {
  Result r;
  r.dx.assign(p.N * p.D, 123.0f);  // must be overwritten
  r.dw = dw0.empty() ? std::vector<float>(p.V * p.D, 0.0f) : dw0;
  r.loss = linear_cross_entropy({.x = p.x.data(),
                                 .w = p.w.data(),
                                 .ab = DType::f32,
                                 .targets = p.t.data(),
                                 .N = p.N,
                                 .D = p.D,
                                 .V = p.V,
                                 .grad_scale = p.scale,
                                 .dx = r.dx.data(),
                                 .dw = r.dw.data(),
                                 .chunk_rows = chunk});
  return r;
}

// Loss against the fp64 reference. The kernel's loss is lse - logit per row from f32 logits
// (errors ~1e-6 of the logits' size); 1e-5 relative is a few times that, while any wrong row,
// missing chunk or mishandled ignored row changes the sum by a whole row's loss (> 1e-2 of it).
TEST(LinearCrossEntropy, LossMatchesReferenceOddVocab) {
  Problem p(37, 29, 1001, 1);
  const double want = ref_loss(p.xd(), p.wd(), p.t, p.N, p.D, p.V);
  std::vector<double> rdx, rdw;
  ref_grads(p.xd(), p.wd(), p.t, p.N, p.D, p.V, p.scale, rdx, rdw);
  test::for_each_isa([&](Isa) {
    for (int64_t chunk : {1, 7, 37, 0, 1000}) {
      SCOPED_TRACE(testing::Message() << "chunk=" << chunk);
      const Result r = run(p, chunk);
      EXPECT_NEAR(r.loss, want, 1e-6 * std::abs(want));
      // f32 GEMMs over V=1001 and D=29 terms: observed ~1e-7; bugs are O(1).
      EXPECT_LT(rel_l2(r.dx, rdx), 1e-5);
      EXPECT_LT(rel_l2(r.dw, rdw), 1e-5);
      for (int64_t i = 0; i < p.N; ++i)
        if (p.t[i] < 0) {
          for (int64_t d = 0; d < p.D; ++d) ASSERT_EQ(r.dx[i * p.D + d], 0.0f) << "row " << i;
        }
    }
  });
}

// Gradients against fp64 central differences of the naive loss. The f32 kernel's gradient is
// accurate to ~1e-7 relative and the differences to ~1e-9, so 1e-5 leaves room for rounding yet
// catches a wrong scale, sign, transposition, chunk offset or target row (all O(1) errors).
TEST(LinearCrossEntropy, GradientsMatchFiniteDifferences) {
  Problem p(11, 7, 101, 2);
  const auto xd = p.xd(), wd = p.wd();
  auto gx = test::numeric_grad(
      [&](const std::vector<double>& x) { return ref_loss(x, wd, p.t, p.N, p.D, p.V); }, xd);
  auto gw = test::numeric_grad(
      [&](const std::vector<double>& w) { return ref_loss(xd, w, p.t, p.N, p.D, p.V); }, wd);
  for (auto& g : gx) g *= p.scale;
  for (auto& g : gw) g *= p.scale;
  // The analytic reference used at larger sizes agrees with the differences.
  std::vector<double> rdx, rdw;
  ref_grads(xd, wd, p.t, p.N, p.D, p.V, p.scale, rdx, rdw);
  EXPECT_LT(rel_l2(rdx, gx), 1e-7);
  EXPECT_LT(rel_l2(rdw, gw), 1e-7);
  test::for_each_isa([&](Isa) {
    for (int64_t chunk : {1, 4, 11}) {
      SCOPED_TRACE(testing::Message() << "chunk=" << chunk);
      const Result r = run(p, chunk);
      EXPECT_LT(rel_l2(r.dx, gx), 1e-5);
      EXPECT_LT(rel_l2(r.dw, gw), 1e-5);
    }
  });
}

TEST_ALL_ISAS(LinearCrossEntropy, WeightGradientAccumulates) {
  Problem p(13, 9, 57, 3);
  const auto dw0 = randn(p.V * p.D, 99);
  const Result fresh = run(p, 5);
  const Result acc = run(p, 5, dw0);
  std::vector<double> want(dw0.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = double(dw0[i]) + fresh.dw[i];
  EXPECT_LT(rel_l2(acc.dw, want), 1e-6);
  EXPECT_EQ(acc.dx, fresh.dx);  // dx is overwritten, not accumulated
  EXPECT_DOUBLE_EQ(acc.loss, fresh.loss);
}

TEST_ALL_ISAS(LinearCrossEntropy, LossOnlyAndIgnoredRows) {
  Problem p(19, 16, 333, 4);
  const Result with_grad = run(p, 6);
  const double loss_only = linear_cross_entropy({.x = p.x.data(),
                                                 .w = p.w.data(),
                                                 .targets = p.t.data(),
                                                 .N = p.N,
                                                 .D = p.D,
                                                 .V = p.V,
                                                 .chunk_rows = 6});
  EXPECT_NEAR(loss_only, with_grad.loss, 1e-6 * std::abs(with_grad.loss));
  std::vector<int32_t> none(p.N, -1);
  std::vector<float> dx(p.N * p.D, 5.0f), dw(p.V * p.D, 0.0f);
  const double l0 = linear_cross_entropy({.x = p.x.data(),
                                          .w = p.w.data(),
                                          .targets = none.data(),
                                          .N = p.N,
                                          .D = p.D,
                                          .V = p.V,
                                          .dx = dx.data(),
                                          .dw = dw.data()});
  EXPECT_EQ(l0, 0.0);
  EXPECT_EQ(dx, std::vector<float>(dx.size(), 0.0f));
  EXPECT_EQ(dw, std::vector<float>(dw.size(), 0.0f));
}

// The automatic chunk (~16 MiB of logits: 1048 rows at V=4001) splits these rows in two.
TEST(LinearCrossEntropy, DefaultChunkSpansSeveralChunks) {
  Problem p(1100, 6, 4001, 5);
  const double want = ref_loss(p.xd(), p.wd(), p.t, p.N, p.D, p.V);
  std::vector<double> rdx, rdw;
  ref_grads(p.xd(), p.wd(), p.t, p.N, p.D, p.V, p.scale, rdx, rdw);
  test::for_each_isa([&](Isa) {
    Allocator& alloc = Allocator::get(Device::cpu);
    alloc.reset_peak();
    const auto before = alloc.stats();
    const Result r = run(p, 0);
    const auto after = alloc.stats();
    EXPECT_NEAR(r.loss, want, 1e-6 * std::abs(want));
    EXPECT_LT(rel_l2(r.dx, rdx), 1e-5);
    EXPECT_LT(rel_l2(r.dw, rdw), 1e-5);
    // The scratch of a call, counted by the allocator: one chunk of f32 logits, and the weight
    // packed once for both chunks' logits GEMMs (4001 x 6 floats and the layout's padding, at most
    // the chunk's scratch).
    const size_t chunk_bytes = 1048u * 4001u * 4u;
    const size_t packed = linear_cross_entropy_packed_bytes(
        p.N, p.D, p.V, DType::f32, linear_cross_entropy_chunks(p.N, p.V, 0, 0), false);
    EXPECT_GE(packed, 4001u * 6u * 4u);
    EXPECT_LE(packed, chunk_bytes);
    EXPECT_EQ(after.num_allocs - before.num_allocs, 2u);
    EXPECT_GE(after.peak_allocated - before.allocated, chunk_bytes + packed);
    EXPECT_LE(after.peak_allocated - before.allocated,
              Allocator::round_size(chunk_bytes) + Allocator::round_size(packed));
    EXPECT_EQ(after.allocated, before.allocated);
  });
}

// The kernel's own exp, probed across its range: with D=1, w=[0,-1] and x_i=a_i the logits of
// row i are [0, -a_i], so its loss is log(1 + e^-a_i) (+ a_i for target 1) and
// dx_i = -grad_scale * (p1_i - [t_i == 1]) with p1_i = e^-a_i / (1 + e^-a_i). f32 gives these to a
// few 1e-7 relative; an exp off by 1e-5 anywhere in [0, 80] fails.
TEST_ALL_ISAS(LinearCrossEntropy, SoftmaxAccurateAcrossExpRange) {
  const int64_t N = 2001;
  std::vector<float> x(N), w = {0.0f, -1.0f}, dx(N);
  std::vector<int32_t> t(N);
  for (int64_t i = 0; i < N; ++i) {
    x[i] = 80.0f * static_cast<float>(i) / static_cast<float>(N - 1);
    t[i] = static_cast<int32_t>(i % 2);
  }
  const double loss = linear_cross_entropy(
      {.x = x.data(), .w = w.data(), .targets = t.data(), .N = N, .D = 1, .V = 2, .dx = dx.data()});
  double want = 0;
  for (int64_t i = 0; i < N; ++i) {
    const double a = x[i], e = std::exp(-a), p1 = e / (1 + e);
    want += std::log1p(e) + (t[i] == 1 ? a : 0.0);
    const double g = -(p1 - (t[i] == 1 ? 1.0 : 0.0));
    ASSERT_NEAR(dx[i], g, 1e-6 * std::abs(g)) << "row " << i << " a=" << a;
  }
  EXPECT_NEAR(loss, want, 1e-6 * want);
  // Per row, at points across the reduction interval: log of the f32 sum 1 + e^-a is good to
  // ~1e-7 absolute (the rounding of the sum), so that bounds the loss, not e^-a.
  for (float a : {0.0f, 0.1f, 0.3f, 0.34f, 0.35f, 0.5f, 0.69f, 1.0f, 2.5f, 10.3f, 40.0f, 86.0f}) {
    const int32_t t0 = 0;
    const double l =
        linear_cross_entropy({.x = &a, .w = w.data(), .targets = &t0, .N = 1, .D = 1, .V = 2});
    EXPECT_NEAR(l, std::log1p(std::exp(-double(a))), 2e-7) << "a=" << a;
  }
}

// The row maximum, which every exp is taken against, wherever it lies in a row: first, in the
// vector body, among the last vector's lanes, in the scalar tail. The logits span hundreds, so a
// maximum short of the true one overflows the exp's clamp and one past it underflows the sum:
// either moves the loss far from the fp64 reference. D = 1 and x = 1 make w the logits.
TEST_ALL_ISAS(LinearCrossEntropy, RowMaximumFoundAnywhere) {
  const int64_t V = 1001;  // past four vectors of any tier, with a scalar tail
  for (int64_t at : {int64_t{0}, int64_t{5}, int64_t{70}, int64_t{192}, int64_t{511}, int64_t{959},
                     int64_t{991}, V - 1}) {
    std::vector<float> w(V);
    for (int64_t j = 0; j < V; ++j) w[j] = -0.5f * static_cast<float>((j * 37) % V);
    w[at] = 150.0f;  // every other logit is <= 0
    const float x = 1.0f;
    std::vector<double> wd(w.begin(), w.end());
    for (int32_t t : {static_cast<int32_t>(at), static_cast<int32_t>((at + 500) % V)}) {
      float dx = 0;
      const double loss = linear_cross_entropy(
          {.x = &x, .w = w.data(), .targets = &t, .N = 1, .D = 1, .V = V, .dx = &dx});
      const double want = ref_loss({1.0}, wd, {t}, 1, 1, V);
      EXPECT_NEAR(loss, want, 1e-5 * std::max(1.0, want))
          << "maximum at " << at << ", target " << t;
      std::vector<double> rdx, rdw;
      ref_grads({1.0}, wd, {t}, 1, 1, V, 1.0, rdx, rdw);
      EXPECT_NEAR(dx, rdx[0], 1e-5 * std::max(1.0, std::abs(rdx[0])))
          << "maximum at " << at << ", target " << t;
    }
  }
}

TEST(LinearCrossEntropy, TargetOutOfRangeNamesTheRow) {
  Problem p(8, 4, 17, 6);
  p.t[5] = 17;
  std::vector<float> dw(p.V * p.D, 1.0f);
  try {
    linear_cross_entropy({.x = p.x.data(),
                          .w = p.w.data(),
                          .targets = p.t.data(),
                          .N = p.N,
                          .D = p.D,
                          .V = p.V,
                          .dw = dw.data()});
    FAIL() << "no error for a target >= V";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("row 5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("17"), std::string::npos) << msg;
  }
  EXPECT_EQ(dw, std::vector<float>(dw.size(), 1.0f));  // nothing was written
  EXPECT_THROW(
      linear_cross_entropy(
          {.x = p.x.data(), .w = p.w.data(), .targets = p.t.data(), .N = p.N, .D = 0, .V = p.V}),
      Error);
}

// bf16 mode: x and w in bf16, logits accumulated in f32, dlogits rounded to bf16 for the two
// backward GEMMs. Against fp64 on the same bf16-rounded inputs: the loss sees only f32 rounding
// (1e-5 relative); the gradients carry the bf16 rounding of dlogits (2^-9 relative per element,
// observed rel_l2 ~2e-3), so 1e-2 is the bound, still far below the O(1) error of a bug.
TEST(LinearCrossEntropy, Bf16MatchesReferenceOnRoundedInputs) {
  Problem p(37, 29, 1001, 7);
  std::vector<bf16> x16(p.x.size()), w16(p.w.size());
  for (size_t i = 0; i < x16.size(); ++i) p.x[i] = bf16_to_float(x16[i] = float_to_bf16(p.x[i]));
  for (size_t i = 0; i < w16.size(); ++i) p.w[i] = bf16_to_float(w16[i] = float_to_bf16(p.w[i]));
  const double want = ref_loss(p.xd(), p.wd(), p.t, p.N, p.D, p.V);
  std::vector<double> rdx, rdw;
  ref_grads(p.xd(), p.wd(), p.t, p.N, p.D, p.V, p.scale, rdx, rdw);
  // {chunk_rows, grad_rows}: one chunk per gradient group, groups of several chunks (the last one
  // short, 37 = 2 x 14 + 9 rows), a group rounded down to a multiple of the chunk (20 -> 14),
  // one group for every row.
  const std::pair<int64_t, int64_t> chunkings[] = {{1, 0},  {7, 0},  {0, 0},   {7, 14},
                                                   {7, 20}, {4, 37}, {3, 1000}};
  int packed_runs = 0;
  for (const auto& [chunk, grad_rows] : chunkings) {
    SCOPED_TRACE(testing::Message() << "chunk=" << chunk << " grad_rows=" << grad_rows);
    const LinearCrossEntropyChunks ch = linear_cross_entropy_chunks(p.N, p.V, chunk, grad_rows);
    EXPECT_TRUE(ch.grad_rows % ch.rows == 0 || ch.grad_rows == p.N) << ch.grad_rows;
    if (grad_rows == 20) {
      EXPECT_EQ(ch.grad_rows, 14);
    }
    std::vector<float> dx(p.N * p.D, 7.0f), dw(p.V * p.D, 0.0f);
    Allocator::get(Device::cpu).reset_peak();
    const auto before = Allocator::get(Device::cpu).stats();
    const double loss = linear_cross_entropy({.x = x16.data(),
                                              .w = w16.data(),
                                              .ab = DType::bf16,
                                              .targets = p.t.data(),
                                              .N = p.N,
                                              .D = p.D,
                                              .V = p.V,
                                              .grad_scale = p.scale,
                                              .dx = dx.data(),
                                              .dw = dw.data(),
                                              .chunk_rows = chunk,
                                              .grad_rows = grad_rows});
    const auto after = Allocator::get(Device::cpu).stats();
    // The weight is packed where several chunks read it (native bf16 GEMMs only).
    const size_t packed = linear_cross_entropy_packed_bytes(p.N, p.D, p.V, DType::bf16, ch, true);
    if (packed > 0) {
      EXPECT_TRUE(ch.rows < p.N && gemm_bf16_native());
      ++packed_runs;
    }
    EXPECT_EQ(after.num_allocs - before.num_allocs, packed > 0 ? 3u : 2u);
    // The scratch the caching allocator handed out: what a meta run books.
    EXPECT_GE(after.peak_allocated - before.allocated,
              size_t(ch.rows * p.V * 4 + ch.grad_rows * p.V * 2) + packed);
    EXPECT_NEAR(loss, want, 1e-6 * std::abs(want));
    EXPECT_LT(rel_l2(dx, rdx), 1e-2);
    EXPECT_LT(rel_l2(dw, rdw), 1e-2);
    for (int64_t i = 0; i < p.N; ++i)
      if (p.t[i] < 0) {
        for (int64_t d = 0; d < p.D; ++d) ASSERT_EQ(dx[i * p.D + d], 0.0f) << "row " << i;
      }
  }
  // Where a chunk's scratch is at least the packed weight (29 x 1001 bf16, the layout's padding).
  if (gemm_bf16_native()) {
    EXPECT_GE(packed_runs, 2);
  }
}

}  // namespace
}  // namespace loom::cpu
