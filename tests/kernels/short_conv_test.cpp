#include "kernels/cpu/short_conv.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// fp64 y = silu(causal depthwise conv(x)), x with row stride ldx.
std::vector<double> reference(const cpu::ShortConv& s, const std::vector<double>& x, int64_t ldx,
                              const std::vector<double>& w) {
  std::vector<double> y(size_t(s.B * s.T * s.C));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t c = 0; c < s.C; ++c) {
        double u = 0;
        for (int64_t j = 0; j < s.W; ++j) {
          const int64_t tt = t - s.W + 1 + j;
          if (tt >= 0) u += w[c * s.W + j] * x[(b * s.T + tt) * ldx + c];
        }
        y[(b * s.T + t) * s.C + c] = u / (1.0 + std::exp(-u));
      }
  return y;
}

}  // namespace

// Forward against fp64, dx and dw against fp64 central differences of L = sum(y * r). C = 70
// spans a full channel block (64) and a tail; T = 2 < W leaves every output with padded taps;
// x is read with a row stride (a view into the fused q/k/v buffer).
TEST(ShortConv, MatchesFp64AndFiniteDifferences) {
  for (const cpu::ShortConv s :
       {cpu::ShortConv{2, 9, 70, 4}, cpu::ShortConv{1, 2, 5, 4}, cpu::ShortConv{2, 6, 3, 1}}) {
    const int64_t ldx = s.C + 3;
    const auto x = test::randn(size_t(s.B * s.T * ldx), 1);
    const auto w = test::randn(size_t(s.C * s.W), 2, 0.7f);
    const auto r = test::randn(size_t(s.B * s.T * s.C), 3);
    const auto xd = test::to_double(x), wd = test::to_double(w);
    auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww) {
      const auto y = reference(s, xx, ldx, ww);
      double L = 0;
      for (size_t i = 0; i < y.size(); ++i) L += y[i] * r[i];
      return L;
    };
    const auto yref = reference(s, xd, ldx, wd);
    auto nx = test::numeric_grad([&](const std::vector<double>& v) { return loss(v, wd); }, xd);
    const auto nw =
        test::numeric_grad([&](const std::vector<double>& v) { return loss(xd, v); }, wd);
    test::for_each_isa([&](cpu::Isa) {
      SCOPED_TRACE(str_cat("B", s.B, " T", s.T, " C", s.C, " W", s.W));
      std::vector<float> y(yref.size());
      cpu::short_conv_forward(s, x.data(), ldx, w.data(), y.data(), 0);
      EXPECT_LT(test::rel_l2(y, yref), 1e-6);
      std::vector<float> dx(x.size(), 0.0f), dw(w.size(), 0.0f);
      cpu::short_conv_backward(s, r.data(), 0, x.data(), ldx, w.data(), dx.data(), ldx, dw.data());
      EXPECT_LT(test::rel_l2(dx, nx), 1e-5);
      EXPECT_LT(test::rel_l2(dw, nw), 1e-5);
    });
  }
}

// dw accumulates (+=), with the same bits for 1 thread and several.
TEST_ALL_ISAS(ShortConv, WeightGradientAccumulatesDeterministically) {
  const cpu::ShortConv s{3, 50, 200, 4};
  const auto x = test::randn(size_t(s.B * s.T * s.C), 4), w = test::randn(size_t(s.C * s.W), 5);
  const auto dy = test::randn(x.size(), 6);
  const int threads = omp_get_max_threads();
  std::vector<std::vector<float>> dws, dxs;
  for (int n : {1, std::max(threads, 3)}) {
    omp_set_num_threads(n);
    std::vector<float> dx(x.size()), dw(w.size(), 0.25f);
    cpu::short_conv_backward(s, dy.data(), 0, x.data(), 0, w.data(), dx.data(), 0, dw.data());
    dws.push_back(dw);
    dxs.push_back(dx);
  }
  omp_set_num_threads(threads);
  EXPECT_EQ(dws[0], dws[1]);
  EXPECT_EQ(dxs[0], dxs[1]);
  std::vector<float> dx(x.size()), dw0(w.size(), 0.0f);
  cpu::short_conv_backward(s, dy.data(), 0, x.data(), 0, w.data(), dx.data(), 0, dw0.data());
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(dws[0][i], dw0[i] + 0.25f, 1e-4f) << i;
}

TEST(ShortConv, RejectsBadArguments) {
  float v = 0;
  test::expect_error(
      [&] {
        cpu::short_conv_forward({1, 2, 4, 0}, &v, 0, &v, &v, 0);
      },
      {"short_conv_forward", "W 0"});
  test::expect_error(
      [&] {
        cpu::short_conv_forward({1, 2, 4, 3}, &v, 2, &v, &v, 0);
      },
      {"short_conv_forward", "row stride of x", "2"});
}
