// kernels/cpu/bias_gate.hpp: the bias add and its gradient on strided rows against naive loops
// (padding between rows untouched), the sigmoid against fp64 and for large |z|, the shared
// expert's gate and its backward against fp64 references and finite differences, bf16 variants,
// thread-count determinism and the kernels' size checks.
#include "kernels/cpu/bias_gate.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::test::same_bits;
using loom::test::to_bf16;
using loom::test::widen;
using loom::test::with_threads;

namespace {

double sigmoid64(double z) {
  return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z));
}

// Gate logits: mostly moderate, a few large (saturated) ones of either sign.
std::vector<float> gate_logits(int64_t M, uint64_t seed) {
  auto z = test::randn(size_t(M), seed, 2.0f);
  if (M > 3) z[1] = 35.0f, z[2] = -42.0f, z[3] = 60.0f;
  return z;
}

}  // namespace

// y is a column slice of a wider buffer (row stride ld > N): each row gets b added (one f32 add
// per element, so the naive loop's bits), the other columns stay as they were.
TEST(BiasGate, AddBiasOnAStridedView) {
  const int64_t M = 23, N = 150, ld = 3 * N + 7, c0 = N + 3;
  const auto buf0 = test::randn(size_t(M * ld), 1);
  const auto b = test::randn(size_t(N), 2);
  auto buf = buf0, ref = buf0;
  cpu::add_bias(buf.data() + c0, M, N, ld, b.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < N; ++c) ref[size_t(m * ld + c0 + c)] += b[size_t(c)];
  EXPECT_TRUE(same_bits(buf, ref));
  // Contiguous (ld = N).
  auto y = test::randn(size_t(M * N), 3), yref = y;
  cpu::add_bias(y.data(), M, N, N, b.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < N; ++c) yref[size_t(m * N + c)] += b[size_t(c)];
  EXPECT_TRUE(same_bits(y, yref));
}

// db += the column sums of a strided dy: the bits of a double sum in row order added to db once;
// against fp64 sums too. A column count that is not a multiple of the kernel's column block.
TEST(BiasGate, BiasGradOnAStridedView) {
  for (int64_t N : {1, 64, 150}) {
    SCOPED_TRACE(testing::Message() << "N " << N);
    const int64_t M = 37, ld = 2 * N + 5, c0 = N + 1;
    const auto buf = test::randn(size_t(M * ld), 4);
    const auto db0 = test::randn(size_t(N), 5);
    auto db = db0;
    cpu::bias_grad(buf.data() + c0, M, N, ld, db.data());
    std::vector<float> ref(static_cast<size_t>(N));
    std::vector<double> exact(static_cast<size_t>(N));
    for (int64_t c = 0; c < N; ++c) {
      double s = 0;
      for (int64_t m = 0; m < M; ++m) s += double(buf[size_t(m * ld + c0 + c)]);
      ref[size_t(c)] = float(double(db0[size_t(c)]) + s);
      exact[size_t(c)] = double(db0[size_t(c)]) + s;
    }
    EXPECT_TRUE(same_bits(db, ref));
    EXPECT_LT(test::rel_l2(db, exact), 1e-7);
  }
  // No rows: db unchanged, bit for bit (a -0 stays -0).
  std::vector<float> db = {-0.0f, 1.5f};
  cpu::bias_grad(nullptr, 0, 2, 2, db.data());
  EXPECT_TRUE(std::signbit(db[0]));
  EXPECT_EQ(db[1], 1.5f);
}

// The f32 sigmoid within three ulps of fp64, in [0, 1] and finite for any |z| (no overflow of
// e^-z), symmetric: s(z) + s(-z) = 1.
TEST(BiasGate, SigmoidIsStableForLargeLogits) {
  for (float z : {-1000.0f, -200.0f, -88.0f, -87.0f, -30.0f, -5.5f, -1e-3f, -0.0f, 0.0f, 1e-3f,
                  0.7f, 5.5f, 30.0f, 87.0f, 88.0f, 89.0f, 200.0f, 1000.0f}) {
    SCOPED_TRACE(testing::Message() << "z " << z);
    const float s = cpu::sigmoid(z);
    const double ref = sigmoid64(double(z));
    ASSERT_TRUE(std::isfinite(s));
    EXPECT_GE(s, 0.0f);
    EXPECT_LE(s, 1.0f);
    // Relative where s is a normal float, absolute (below the smallest normal) otherwise.
    EXPECT_NEAR(s, ref, std::max(3.6e-7 * ref, 1.2e-38));
    EXPECT_NEAR(double(s) + double(cpu::sigmoid(-z)), 1.0, 2.4e-7);
  }
  EXPECT_EQ(cpu::sigmoid(0.0f), 0.5f);
  EXPECT_EQ(cpu::sigmoid(1000.0f), 1.0f);
  EXPECT_EQ(cpu::sigmoid(-1000.0f), 0.0f);
}

// y += s(z_t) ys[t]: the bits of the f32 loop (the product rounded, then added), within f32
// rounding of fp64; bf16 ys gives the bits of its widened f32 copy.
TEST(BiasGate, GateForwardMatchesReference) {
  const int64_t M = 29, d = 37;
  const auto z = gate_logits(M, 6);
  const auto ys = test::randn(size_t(M * d), 7);
  const auto y0 = test::randn(size_t(M * d), 8);
  auto y = y0, ref = y0;
  cpu::sigmoid_gate_forward(z.data(), ys.data(), M, d, y.data());
  std::vector<double> exact(size_t(M * d));
  for (int64_t t = 0; t < M; ++t) {
    const float s = cpu::sigmoid(z[size_t(t)]);
    for (int64_t c = 0; c < d; ++c) {
      const size_t i = size_t(t * d + c);
      ref[i] += s * ys[i];
      exact[i] = double(y0[i]) + sigmoid64(z[size_t(t)]) * double(ys[i]);
    }
  }
  EXPECT_TRUE(same_bits(y, ref));
  EXPECT_LT(test::max_abs_diff(y, exact), 1e-6);

  const auto ys16 = to_bf16(ys);
  const auto wide = widen(ys16);
  auto y16 = y0, yw = y0;
  cpu::sigmoid_gate_forward(z.data(), ys16.data(), M, d, y16.data());
  cpu::sigmoid_gate_forward(z.data(), wide.data(), M, d, yw.data());
  EXPECT_TRUE(same_bits(y16, yw));
}

// The backward against fp64 central differences of L = sum dy * (y0 + s(z) ys) in z and ys (the
// moderate logits: at |z| > 30 the fp64 sigmoid rounds to 0 or 1 and differences see nothing),
// against the analytic e^-|z| / (1 + e^-|z|)^2 at the saturated ones (nonzero: no 1 - s
// rounded to 0); bf16 ys and dys against the widened and rounded f32 results.
TEST(BiasGate, GateBackwardMatchesFiniteDifferences) {
  const int64_t M = 11, d = 9;
  const auto z = gate_logits(M, 9);
  const auto ys = test::randn(size_t(M * d), 10);
  const auto dy = test::randn(size_t(M * d), 11);
  std::vector<float> dys(size_t(M * d)), dz(static_cast<size_t>(M));
  cpu::sigmoid_gate_backward(dy.data(), z.data(), ys.data(), M, d, dys.data(), dz.data());

  const auto zd = test::to_double(z), ysd = test::to_double(ys);
  auto loss = [&](const std::vector<double>& zz, const std::vector<double>& yy) {
    double l = 0;
    for (int64_t t = 0; t < M; ++t)
      for (int64_t c = 0; c < d; ++c)
        l += double(dy[size_t(t * d + c)]) * sigmoid64(zz[size_t(t)]) * yy[size_t(t * d + c)];
    return l;
  };
  const auto gz =
      test::numeric_grad([&](const std::vector<double>& v) { return loss(v, ysd); }, zd);
  const auto gys =
      test::numeric_grad([&](const std::vector<double>& v) { return loss(zd, v); }, ysd);
  EXPECT_LT(test::rel_l2(dys, gys), 1e-6);
  for (int64_t t = 0; t < M; ++t) {
    SCOPED_TRACE(testing::Message() << "token " << t << " z " << z[size_t(t)]);
    if (std::abs(z[size_t(t)]) < 30) {
      EXPECT_NEAR(dz[size_t(t)], gz[size_t(t)], 1e-6 * std::abs(gz[size_t(t)]) + 1e-9);
    } else {
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += double(dy[size_t(t * d + c)]) * ysd[size_t(t * d + c)];
      const double e = std::exp(-std::abs(zd[size_t(t)]));
      const double want = dot * e / ((1 + e) * (1 + e));
      EXPECT_NE(dz[size_t(t)], 0.0f);
      EXPECT_NEAR(dz[size_t(t)], want, 1e-6 * std::abs(want));
    }
  }

  // bf16 ys (read widened) and bf16 dys (rounded): the f32 kernel's bits on the widened values,
  // and the f32 dys rounded.
  const auto ys16 = to_bf16(ys);
  const auto wide = widen(ys16);
  std::vector<float> dys_w(dys.size()), dz_w(dz.size()), dys_a(dys.size()), dz_a(dz.size()),
      dz_b(dz.size()), dz_c(dz.size());
  std::vector<bf16> dys16(dys.size()), dys16b(dys.size());
  cpu::sigmoid_gate_backward(dy.data(), z.data(), wide.data(), M, d, dys_w.data(), dz_w.data());
  cpu::sigmoid_gate_backward(dy.data(), z.data(), ys16.data(), M, d, dys_a.data(), dz_a.data());
  EXPECT_TRUE(same_bits(dys_a, dys_w));
  EXPECT_TRUE(same_bits(dz_a, dz_w));
  cpu::sigmoid_gate_backward(dy.data(), z.data(), ys16.data(), M, d, dys16.data(), dz_b.data());
  EXPECT_TRUE(same_bits(dys16, to_bf16(dys_w)));
  EXPECT_TRUE(same_bits(dz_b, dz_w));
  cpu::sigmoid_gate_backward(dy.data(), z.data(), ys.data(), M, d, dys16b.data(), dz_c.data());
  EXPECT_TRUE(same_bits(dys16b, to_bf16(dys)));
  EXPECT_TRUE(same_bits(dz_c, dz));
}

// Sizes past the kernels' threading threshold: 1 and 2 threads give the same bits.
TEST(BiasGate, ResultsDoNotDependOnTheThreadCount) {
  const int64_t M = 700, N = 200, ld = 330, d = 96;
  const auto buf0 = test::randn(size_t(M * ld), 12);
  const auto b = test::randn(size_t(N), 13);
  const auto db0 = test::randn(size_t(N), 14);
  const auto z = gate_logits(M, 15);
  const auto ys = to_bf16(test::randn(size_t(M * d), 16));
  const auto dy = test::randn(size_t(M * d), 17);
  struct Out {
    std::vector<float> buf, db, y, dz;
    std::vector<bf16> dys;
  };
  auto run = [&] {
    Out o;
    o.buf = buf0;
    cpu::add_bias(o.buf.data() + 9, M, N, ld, b.data());
    o.db = db0;
    cpu::bias_grad(buf0.data() + 9, M, N, ld, o.db.data());
    o.y = dy;
    cpu::sigmoid_gate_forward(z.data(), ys.data(), M, d, o.y.data());
    o.dys.resize(size_t(M * d));
    o.dz.resize(size_t(M));
    cpu::sigmoid_gate_backward(dy.data(), z.data(), ys.data(), M, d, o.dys.data(), o.dz.data());
    return o;
  };
  Out one, two;
  with_threads(1, [&] { one = run(); });
  with_threads(2, [&] { two = run(); });
  EXPECT_TRUE(same_bits(one.buf, two.buf));
  EXPECT_TRUE(same_bits(one.db, two.db));
  EXPECT_TRUE(same_bits(one.y, two.y));
  EXPECT_TRUE(same_bits(one.dys, two.dys));
  EXPECT_TRUE(same_bits(one.dz, two.dz));
}

// Sizes are errors naming the kernel, before anything runs.
TEST(BiasGate, KernelsCheckTheirSizes) {
  std::vector<float> f(64, 1.0f), out(64, 0.0f);
  test::expect_error([&] { cpu::add_bias(out.data(), 2, 8, 7, f.data()); },
                     {"add_bias", "row stride 7", "row width 8"});
  test::expect_error([&] { cpu::bias_grad(f.data(), -1, 4, 4, out.data()); },
                     {"bias_grad", "M must be >= 0", "-1"});
  test::expect_error([&] { cpu::sigmoid_gate_forward(f.data(), f.data(), 2, 0, out.data()); },
                     {"sigmoid_gate_forward", "row width must be > 0"});
  test::expect_error(
      [&] {
        cpu::sigmoid_gate_backward(f.data(), f.data(), f.data(), 2, 0, out.data(), out.data());
      },
      {"sigmoid_gate_backward", "row width"});
  EXPECT_EQ(out, std::vector<float>(64, 0.0f));
}
