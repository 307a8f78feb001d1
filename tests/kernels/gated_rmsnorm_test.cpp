#include "kernels/cpu/gated_rmsnorm.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

struct Case {
  bool gate, weight;
};

std::string name(const Case& c) {
  return std::string(c.gate ? "gate" : "no gate") + (c.weight ? ", weight" : ", no weight");
}

// fp64 y of rows x heads vectors of dim values (g with row stride ldg).
std::vector<double> reference(int64_t rows, int64_t heads, int64_t dim, double eps,
                              const std::vector<double>& x, const double* g, int64_t ldg,
                              const double* w) {
  std::vector<double> y(x.size());
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      const double* xr = x.data() + (m * heads + h) * dim;
      double ss = 0;
      for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
      const double rs = 1.0 / std::sqrt(ss / double(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        double v = xr[i] * rs * (w ? w[i] : 1.0);
        if (g) {
          const double gi = g[m * ldg + h * dim + i];
          v *= gi / (1.0 + std::exp(-gi));
        }
        y[(m * heads + h) * dim + i] = v;
      }
    }
  return y;
}

}  // namespace

// Forward against fp64 and every gradient (x, gate, weight) against fp64 central differences of
// the fp64 forward, for L = sum(y * r); the gate is read from a strided buffer as the fused
// projection GEMM writes it.
TEST(GatedRmsNorm, MatchesFp64AndFiniteDifferences) {
  const int64_t rows = 5, heads = 3, dim = 37, HD = heads * dim, ldg = HD + 11;
  const float eps = 1e-6f;
  const auto x = test::randn(size_t(rows * HD), 1);
  const auto g = test::randn(size_t(rows * ldg), 2, 2.0f);
  auto w = test::randn(size_t(dim), 3);
  for (float& v : w) v += 1.0f;
  const auto r = test::randn(size_t(rows * HD), 4);
  const auto xd = test::to_double(x), gd = test::to_double(g), wd = test::to_double(w);
  for (const Case c : {Case{true, true}, Case{false, true}, Case{true, false}}) {
    auto loss = [&](const std::vector<double>& xx, const std::vector<double>& gg,
                    const std::vector<double>& ww) {
      const auto y = reference(rows, heads, dim, eps, xx, c.gate ? gg.data() : nullptr, ldg,
                               c.weight ? ww.data() : nullptr);
      double L = 0;
      for (size_t i = 0; i < y.size(); ++i) L += y[i] * r[i];
      return L;
    };
    const auto yref = reference(rows, heads, dim, eps, xd, c.gate ? gd.data() : nullptr, ldg,
                                c.weight ? wd.data() : nullptr);
    const auto nx =
        test::numeric_grad([&](const std::vector<double>& v) { return loss(v, gd, wd); }, xd);
    const auto ng =
        test::numeric_grad([&](const std::vector<double>& v) { return loss(xd, v, wd); }, gd);
    const auto nw =
        test::numeric_grad([&](const std::vector<double>& v) { return loss(xd, gd, v); }, wd);
    test::for_each_isa([&](cpu::Isa) {
      SCOPED_TRACE(name(c));
      const cpu::GatedRmsNorm s{rows, heads, dim, eps};
      const float* gp = c.gate ? g.data() : nullptr;
      const float* wp = c.weight ? w.data() : nullptr;
      std::vector<float> y(x.size()), rstd(size_t(rows * heads));
      cpu::gated_rmsnorm_forward(s, x.data(), gp, ldg, wp, y.data(), rstd.data());
      EXPECT_LT(test::rel_l2(y, yref), 1e-6);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> dx(x.size(), nan), dg(g.size(), 0.0f), dw(size_t(dim), 0.0f);
      cpu::gated_rmsnorm_backward(s, r.data(), x.data(), gp, ldg, wp, rstd.data(), dx.data(),
                                  c.gate ? dg.data() : nullptr, ldg,
                                  c.weight ? dw.data() : nullptr);
      EXPECT_LT(test::rel_l2(dx, nx), 1e-5);
      if (c.gate) {
        EXPECT_LT(test::rel_l2(dg, ng), 1e-5);
        for (int64_t m = 0; m < rows; ++m)  // the padding between gate rows is not written
          for (int64_t i = HD; i < ldg; ++i) ASSERT_EQ(dg[m * ldg + i], 0.0f);
      }
      if (c.weight) {
        EXPECT_LT(test::rel_l2(dw, nw), 1e-5);
      }
    });
  }
}

// dw is accumulated (+=) and has the same bits with 1 thread and with several.
TEST_ALL_ISAS(GatedRmsNorm, WeightGradientAccumulatesDeterministically) {
  const int64_t rows = 300, heads = 2, dim = 64, HD = heads * dim;
  const auto x = test::randn(size_t(rows * HD), 5), g = test::randn(size_t(rows * HD), 6);
  const auto w = test::randn(size_t(dim), 7), dy = test::randn(size_t(rows * HD), 8);
  const cpu::GatedRmsNorm s{rows, heads, dim, 1e-6f};
  std::vector<float> y(x.size()), rstd(size_t(rows * heads)), dx(x.size()), dg(x.size());
  cpu::gated_rmsnorm_forward(s, x.data(), g.data(), 0, w.data(), y.data(), rstd.data());
  const int threads = omp_get_max_threads();
  std::vector<std::vector<float>> dws;
  for (int n : {1, std::max(threads, 3)}) {
    omp_set_num_threads(n);
    std::vector<float> dw(size_t(dim), 0.5f);
    cpu::gated_rmsnorm_backward(s, dy.data(), x.data(), g.data(), 0, w.data(), rstd.data(),
                                dx.data(), dg.data(), 0, dw.data());
    dws.push_back(dw);
  }
  omp_set_num_threads(threads);
  EXPECT_EQ(dws[0], dws[1]);
  std::vector<float> dw0(size_t(dim), 0.0f);
  cpu::gated_rmsnorm_backward(s, dy.data(), x.data(), g.data(), 0, w.data(), rstd.data(), dx.data(),
                              dg.data(), 0, dw0.data());
  for (int64_t i = 0; i < dim; ++i) EXPECT_NEAR(dws[0][i], dw0[i] + 0.5f, 1e-4f) << i;
}

TEST(GatedRmsNorm, RejectsBadArguments) {
  float v = 0;
  test::expect_error(
      [&] {
        cpu::gated_rmsnorm_forward({1, 2, 4, 1e-6f}, &v, &v, 5, nullptr, &v, &v);
      },
      {"gated_rmsnorm_forward", "row stride of the gate", "5", "8"});
  test::expect_error(
      [&] {
        cpu::gated_rmsnorm_forward({1, 0, 4, 1e-6f}, &v, nullptr, 0, nullptr, &v, &v);
      },
      {"gated_rmsnorm_forward", "heads"});
}
