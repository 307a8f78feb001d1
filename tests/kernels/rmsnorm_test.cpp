#include "kernels/cpu/rmsnorm.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cast.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

struct Shape {
  int64_t rows, dim;
};

// Rows of very different scales, some small enough that eps matters (mean(x^2) ~ 1e-4 vs eps
// 1e-5), so a misplaced eps or a wrong mean shows up.
std::vector<float> make_x(int64_t rows, int64_t dim, uint64_t seed) {
  auto x = test::randn(static_cast<size_t>(rows * dim), seed);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i) x[r * dim + i] *= (r % 3 == 0) ? 0.01f : float(1 + r % 5);
  return x;
}

std::vector<float> make_w(int64_t dim, uint64_t seed) {
  auto w = test::randn(static_cast<size_t>(dim), seed, 0.5f);
  for (auto& v : w) v += 1.0f;
  return w;
}

// Naive fp64 reference of one row.
void ref_row(const double* x, const double* w, int64_t dim, double eps, double* y, double* rstd) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  const double rs = 1.0 / std::sqrt(ss / double(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i] * rs * w[i];
  if (rstd) *rstd = rs;
}

constexpr float kEps = 1e-5f;

}  // namespace

// f32 against fp64: per-element error is a few ulp (~1e-7 relative), so 1e-6 holds with margin,
// while dividing by dim-1, dropping eps or forgetting w costs > 1e-4.
TEST_ALL_ISAS(RMSNorm, ForwardMatchesFp64Reference) {
  for (auto [rows, dim] : std::vector<Shape>{{37, 50}, {37, 288}, {37, 513}, {1, 7}}) {
    auto x = make_x(rows, dim, 1);
    auto w = make_w(dim, 2);
    std::vector<float> y(static_cast<size_t>(rows * dim)), rstd(static_cast<size_t>(rows));
    cpu::rmsnorm_forward(x.data(), w.data(), rows, dim, kEps, y.data(), rstd.data());
    auto xd = test::to_double(x), wd = test::to_double(w);
    std::vector<double> yref(y.size()), rref(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      ref_row(&xd[r * dim], wd.data(), dim, kEps, &yref[r * dim], &rref[r]);
    EXPECT_LT(test::rel_l2(y, yref), 1e-6) << rows << "x" << dim;
    EXPECT_LT(test::rel_l2(rstd, rref), 1e-6) << rows << "x" << dim;
  }
}

// L = sum(y * r) with random r: the kernel's dx and dw (from dy = r) against fp64 central
// differences of the fp64 reference. The f32 kernel is good to ~1e-6 relative and the fp64 finite
// differences to ~1e-9, so 1e-5 passes with margin; a wrong sign or a missing term in the
// projection of dx, or a dw not scaled by rstd, is off by > 1e-2.
TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  for (auto [rows, dim] : std::vector<Shape>{{37, 50}, {37, 288}, {37, 513}, {301, 50}}) {
    auto x = make_x(rows, dim, 3);
    auto w = make_w(dim, 4);
    auto r = test::randn(static_cast<size_t>(rows * dim), 5);
    auto xd = test::to_double(x), wd = test::to_double(w), rd = test::to_double(r);
    std::vector<double> yrow(static_cast<size_t>(dim));
    // dx: row r of L depends only on row r of x.
    std::vector<double> num_dx(static_cast<size_t>(rows * dim));
    for (int64_t row = 0; row < rows; ++row) {
      auto loss = [&](const std::vector<double>& xr) {
        ref_row(xr.data(), wd.data(), dim, kEps, yrow.data(), nullptr);
        double L = 0;
        for (int64_t i = 0; i < dim; ++i) L += yrow[i] * rd[row * dim + i];
        return L;
      };
      auto g = test::numeric_grad(
          loss, std::vector<double>(xd.begin() + row * dim, xd.begin() + (row + 1) * dim));
      std::copy(g.begin(), g.end(), num_dx.begin() + row * dim);
    }
    auto loss_w = [&](const std::vector<double>& wv) {
      double L = 0;
      for (int64_t row = 0; row < rows; ++row) {
        ref_row(&xd[row * dim], wv.data(), dim, kEps, yrow.data(), nullptr);
        for (int64_t i = 0; i < dim; ++i) L += yrow[i] * rd[row * dim + i];
      }
      return L;
    };
    const auto num_dw = test::numeric_grad(loss_w, wd);

    test::for_each_isa([&](cpu::Isa) {
      std::vector<float> y(static_cast<size_t>(rows * dim)), rstd(static_cast<size_t>(rows));
      cpu::rmsnorm_forward(x.data(), w.data(), rows, dim, kEps, y.data(), rstd.data());
      std::vector<float> dx(static_cast<size_t>(rows * dim), 0.0f),
          dw(static_cast<size_t>(dim), 0.0f);
      cpu::rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                            dw.data());
      EXPECT_LT(test::rel_l2(dx, num_dx), 1e-5) << rows << "x" << dim;
      EXPECT_LT(test::rel_l2(dw, num_dw), 1e-5) << rows << "x" << dim;

      // Accumulation: starting from random dx, dw must give start + gradient (to the rounding of
      // one add, which the compiler may fuse into an FMA), and dw must have the same bits for
      // any thread count.
      auto dx2 = test::randn(dx.size(), 6), dw2 = test::randn(dw.size(), 7);
      const auto dx_start = dx2, dw_start = dw2;
      cpu::rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), rows, dim, dx2.data(),
                            dw2.data());
      for (size_t i = 0; i < dx.size(); ++i)
        ASSERT_NEAR(dx2[i], dx_start[i] + dx[i], 2e-7 * (std::abs(dx_start[i]) + std::abs(dx[i])))
            << i;
      for (size_t i = 0; i < dw.size(); ++i)
        ASSERT_NEAR(dw2[i], dw_start[i] + dw[i], 2e-7 * (std::abs(dw_start[i]) + std::abs(dw[i])))
            << i;
      const int saved = omp_get_max_threads();
      for (int threads : {1, 3}) {
        omp_set_num_threads(threads);
        std::vector<float> dx3(dx.size(), 0.0f), dw3(dw.size(), 0.0f);
        cpu::rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), rows, dim, dx3.data(),
                              dw3.data());
        EXPECT_EQ(std::memcmp(dw3.data(), dw.data(), dw.size() * sizeof(float)), 0)
            << "threads=" << threads;
        EXPECT_EQ(std::memcmp(dx3.data(), dx.data(), dx.size() * sizeof(float)), 0)
            << "threads=" << threads;
      }
      omp_set_num_threads(saved);
    });
  }
}

// The bf16 output (mixed precision) is the f32 kernel's result rounded: bit for bit what
// cast_f32_to_bf16 makes of it, with the same rstd, on every tier and for any thread count.
TEST_ALL_ISAS(RMSNorm, Bf16OutputIsTheRoundedF32Result) {
  for (auto [rows, dim] : std::vector<Shape>{{37, 288}, {130, 512}, {5, 37}, {1, 1}}) {
    const auto x = make_x(rows, dim, 11);
    const auto w = make_w(dim, 12);
    std::vector<float> y(static_cast<size_t>(rows * dim)), rstd(static_cast<size_t>(rows));
    cpu::rmsnorm_forward(x.data(), w.data(), rows, dim, kEps, y.data(), rstd.data());
    std::vector<bf16> want(y.size());
    cpu::cast_f32_to_bf16(y.data(), want.data(), int64_t(y.size()));
    const int saved = omp_get_max_threads();
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      std::vector<bf16> y16(y.size());
      std::vector<float> rstd16(rstd.size());
      cpu::rmsnorm_forward(x.data(), w.data(), rows, dim, kEps, y16.data(), rstd16.data());
      for (size_t i = 0; i < y16.size(); ++i)
        ASSERT_EQ(y16[i].bits, want[i].bits)
            << rows << "x" << dim << " threads " << threads << " " << i;
      EXPECT_EQ(std::memcmp(rstd16.data(), rstd.data(), rstd.size() * sizeof(float)), 0);
    }
    omp_set_num_threads(saved);
  }
}

// The block input's rounding fused into the norm: bit for bit the two casts and the bf16-output
// norm, on every tier and for any thread count (dim 288 and 512 in whole vectors, 37 and 1 with
// scalar tails; NaN and values that round up a binade among the inputs).
TEST_ALL_ISAS(RMSNorm, RoundingInputIsTheCastsThenTheNorm) {
  for (auto [rows, dim] : std::vector<Shape>{{37, 288}, {130, 512}, {5, 37}, {1, 1}}) {
    auto x = make_x(rows, dim, 31);
    if (x.size() > 20) {
      x[3] = 1.99999988f;  // rounds up to 2
      x[17] = -3.3e38f;    // rounds to -inf's neighbour
    }
    const auto w = make_w(dim, 32);
    std::vector<bf16> want_x16(x.size()), want_y(x.size());
    std::vector<float> want_x(x.size()), want_rstd(static_cast<size_t>(rows));
    cpu::cast_f32_to_bf16(x.data(), want_x16.data(), int64_t(x.size()));
    cpu::cast_bf16_to_f32(want_x16.data(), want_x.data(), int64_t(x.size()));
    cpu::rmsnorm_forward(want_x.data(), w.data(), rows, dim, kEps, want_y.data(), want_rstd.data());
    const int saved = omp_get_max_threads();
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      auto xr = x;
      std::vector<bf16> x16(x.size()), y(x.size());
      std::vector<float> rstd(want_rstd.size());
      cpu::rmsnorm_forward_rounding_input(xr.data(), x16.data(), w.data(), rows, dim, kEps,
                                          y.data(), rstd.data());
      EXPECT_EQ(std::memcmp(xr.data(), want_x.data(), xr.size() * sizeof(float)), 0)
          << rows << "x" << dim << " threads " << threads;
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(x16[i].bits, want_x16[i].bits) << rows << "x" << dim << " " << i;
        ASSERT_EQ(y[i].bits, want_y[i].bits) << rows << "x" << dim << " " << i;
      }
      EXPECT_EQ(std::memcmp(rstd.data(), want_rstd.data(), rstd.size() * sizeof(float)), 0);
    }
    omp_set_num_threads(saved);
  }
}

// x saved in bf16 (a mixed-precision block input): the backward reading it is bit for bit the f32
// backward on its widened copy (dx and dw accumulating onto random starts), on every tier and
// for any thread count.
TEST_ALL_ISAS(RMSNorm, BackwardOfBf16InputIsTheF32OneOnItsWidenedCopy) {
  for (auto [rows, dim] : std::vector<Shape>{{37, 288}, {130, 512}, {5, 37}, {1, 1}}) {
    const auto x = make_x(rows, dim, 21);
    const auto w = make_w(dim, 22);
    std::vector<bf16> x16(x.size());
    cpu::cast_f32_to_bf16(x.data(), x16.data(), int64_t(x.size()));
    std::vector<float> xw(x.size());
    cpu::cast_bf16_to_f32(x16.data(), xw.data(), int64_t(x.size()));
    const auto dy = test::randn(x.size(), 23);
    std::vector<float> y(x.size()), rstd(static_cast<size_t>(rows));
    cpu::rmsnorm_forward(xw.data(), w.data(), rows, dim, kEps, y.data(), rstd.data());
    auto dx = test::randn(x.size(), 24), dw = test::randn(size_t(dim), 25);
    const auto dx0 = dx, dw0 = dw;
    cpu::rmsnorm_backward(dy.data(), xw.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                          dw.data());
    const int saved = omp_get_max_threads();
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      auto dx16 = dx0, dw16 = dw0;
      cpu::rmsnorm_backward(dy.data(), x16.data(), w.data(), rstd.data(), rows, dim, dx16.data(),
                            dw16.data());
      EXPECT_EQ(std::memcmp(dx16.data(), dx.data(), dx.size() * sizeof(float)), 0)
          << rows << "x" << dim << " threads " << threads;
      EXPECT_EQ(std::memcmp(dw16.data(), dw.data(), dw.size() * sizeof(float)), 0)
          << rows << "x" << dim << " threads " << threads;
    }
    omp_set_num_threads(saved);
  }
}

TEST(RMSNorm, RejectsBadShapes) {
  float f = 1, g = 1;
  EXPECT_THROW(cpu::rmsnorm_forward(&f, &f, 1, 0, kEps, &g, &g), Error);
  EXPECT_THROW(cpu::rmsnorm_forward(&f, &f, -1, 1, kEps, &g, &g), Error);
  EXPECT_THROW(cpu::rmsnorm_backward(&f, &f, &f, &f, 1, -3, &g, &g), Error);
}
