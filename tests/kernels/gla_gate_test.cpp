#include "kernels/cpu/gla_gate.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

constexpr float kNoClamp = -std::numeric_limits<float>::infinity();

double logsigmoid(double z) {
  return std::min(z, 0.0) - std::log1p(std::exp(-std::abs(z)));
}
double gate(double z, double normalizer, double clamp_min) {
  return std::max(logsigmoid(z) / normalizer, clamp_min);
}

// Logits N(0, 3^2) as a trained gate sees them, plus tails where a naive log(sigmoid) would
// overflow or lose every digit.
std::vector<float> logits(size_t n, uint64_t seed) {
  auto z = test::randn(n, seed, 3.0f);
  const float tails[] = {-200.0f, -90.0f, -30.0f, -1e-4f, 1e-4f, 17.0f, 30.0f, 90.0f, 200.0f};
  for (size_t i = 0; i < 9 && i < n; ++i) z[i * 3] = tails[i];
  return z;
}

}  // namespace

// Per element against fp64: relative 1e-6 (the log1p series and exp are both within a few ulp),
// with a 1e-30 absolute floor for z >> 0, where the f32 exp clamps e^-z at e^-87.
TEST_ALL_ISAS(GlaGate, ForwardMatchesFp64) {
  const int64_t rows = 7, width = 37;
  const auto z = logits(size_t(rows * width), 1);
  const auto bias = test::randn(size_t(width), 9);
  for (float clamp : {kNoClamp, -0.1f}) {
    for (float normalizer : {16.0f, 1.0f}) {
      std::vector<float> gk(z.size());
      // Without the bias first (the tails as drawn), then with it.
      cpu::gla_gate_forward(z.data(), nullptr, rows, width, normalizer, clamp, gk.data());
      for (size_t i = 0; i < z.size(); ++i) {
        const double ref = gate(z[i], normalizer, clamp);
        ASSERT_NEAR(gk[i], ref, 1e-6 * std::abs(ref) + 1e-30) << "z " << z[i];
      }
      cpu::gla_gate_forward(z.data(), bias.data(), rows, width, normalizer, clamp, gk.data());
      int clamped = 0;
      for (size_t i = 0; i < z.size(); ++i) {
        const double ref = gate(double(z[i] + bias[i % width]), normalizer, clamp);
        clamped += ref == double(clamp);
        ASSERT_NEAR(gk[i], ref, 1e-6 * std::abs(ref) + 1e-30)
            << "z " << z[i] << " normalizer " << normalizer << " clamp " << clamp;
      }
      if (clamp != kNoClamp && normalizer == 1.0f) {
        EXPECT_GT(clamped, 0);
      }  // the clamp was hit
    }
  }
}

// dz against fp64 central differences of the fp64 gate, element by element (each gk depends on
// its own z only); where the clamp holds the gradient is exactly 0. dbias accumulates the column
// sums of dz.
TEST_ALL_ISAS(GlaGate, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 5, width = 41;
  const auto z = logits(size_t(rows * width), 2);
  const auto dgk = test::randn(z.size(), 3);
  const auto bias = test::randn(size_t(width), 10);
  for (float clamp : {kNoClamp, -0.1f}) {
    const float normalizer = clamp == kNoClamp ? 16.0f : 1.0f;
    std::vector<float> dz(z.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> db(size_t(width), 0.5f);
    cpu::gla_gate_backward(dgk.data(), z.data(), bias.data(), rows, width, normalizer, clamp,
                           dz.data(), db.data());
    std::vector<double> num(z.size()), nb(size_t(width), 0.5);
    for (size_t i = 0; i < z.size(); ++i) {
      const double zi = double(z[i] + bias[i % width]);
      const double h = 1e-6 * std::max(1.0, std::abs(zi));
      num[i] =
          dgk[i] * (gate(zi + h, normalizer, clamp) - gate(zi - h, normalizer, clamp)) / (2 * h);
      // A difference straddling the clamp's kink measures neither side.
      if (std::abs(logsigmoid(zi) / normalizer - clamp) < 1e-4) num[i] = dz[i];
      nb[i % width] += num[i];
      ASSERT_TRUE(std::isfinite(dz[i])) << i;
      ASSERT_NEAR(dz[i], num[i], 1e-5 * std::abs(num[i]) + 1e-9) << "z " << z[i];
      if (logsigmoid(zi) / normalizer < clamp - 1e-4) {
        ASSERT_EQ(dz[i], 0.0f);
      }
    }
    EXPECT_LT(test::rel_l2(db, nb), 1e-5);
  }
}

TEST_ALL_ISAS(GlaGate, InPlace) {
  const int64_t rows = 3, width = 29;
  auto z = logits(size_t(rows * width), 4);
  std::vector<float> out(z.size());
  const auto bias = test::randn(size_t(width), 11);
  cpu::gla_gate_forward(z.data(), bias.data(), rows, width, 16.0f, kNoClamp, out.data());
  cpu::gla_gate_forward(z.data(), bias.data(), rows, width, 16.0f, kNoClamp, z.data());
  EXPECT_EQ(out, z);
}

TEST(GlaGate, RejectsBadArguments) {
  float z = 0, g = 0;
  test::expect_error([&] { cpu::gla_gate_forward(&z, nullptr, 1, 1, 0.0f, kNoClamp, &g); },
                     {"gla_gate_forward", "normalizer", "0"});
  test::expect_error(
      [&] { cpu::gla_gate_backward(&z, &z, nullptr, 1, 0, 16.0f, kNoClamp, &g, nullptr); },
      {"gla_gate_backward", "width"});
}

// dbias has the same bits with 1 thread and several (a sum over many rows).
TEST_ALL_ISAS(GlaGate, BiasGradientDeterministic) {
  const int64_t rows = 2000, width = 24;
  const auto z = logits(size_t(rows * width), 12), dgk = test::randn(z.size(), 13);
  const auto bias = test::randn(size_t(width), 14);
  const int threads = omp_get_max_threads();
  std::vector<std::vector<float>> dbs;
  for (int n : {1, std::max(threads, 3)}) {
    omp_set_num_threads(n);
    std::vector<float> dz(z.size()), db(size_t(width), 0.0f);
    cpu::gla_gate_backward(dgk.data(), z.data(), bias.data(), rows, width, 16.0f, kNoClamp,
                           dz.data(), db.data());
    dbs.push_back(db);
  }
  omp_set_num_threads(threads);
  EXPECT_EQ(dbs[0], dbs[1]);
}
