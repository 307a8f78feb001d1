#include "kernels/cpu/adamw.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// torch.optim.AdamW written out in fp64, one element at a time.
struct RefAdamW {
  std::vector<double> p, m, v;
  void step(const cpu::AdamWArgs& a, const std::vector<float>& g) {
    const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay;
    const double bc1 = 1 - std::pow(b1, double(a.step)), bc2 = 1 - std::pow(b2, double(a.step));
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * double(g[i]) * g[i];
      const double mhat = m[i] / bc1, vhat = v[i] / bc2;
      p[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
};

// Max over elements of |a - b| / (|b| + floor).
template <class A>
double max_rel(const A& a, const std::vector<double>& b, double floor) {
  double e = 0;
  for (size_t i = 0; i < b.size(); ++i)
    e = std::max(e, std::abs(double(a[i]) - b[i]) / (std::abs(b[i]) + floor));
  return e;
}

}  // namespace

// Several steps against fp64 with fresh random gradients each step. Tolerances: f32 rounding gives
// ~1e-7 relative per op, so parameters (size ~1) agree to 1e-6 absolute and moments to 1e-5
// relative (m relative to its typical size 0.1 * grad scale, since it can cancel to ~0). The
// configurations make every term matter: lr * update ~ 1e-2 (a missing bias correction is off by
// ~10x at step 1), lr * wd * p ~ 1e-3 (decay applied after the update, or coupled into g, is off by
// > 1e-5), and in the second config eps = 1e-3 against sqrt(vhat) ~ 1e-3 (eps inside the sqrt or
// before bias correction is off by O(lr)).
TEST_ALL_ISAS(AdamW, MatchesFp64ReferenceOverSteps) {
  struct Config {
    cpu::AdamWArgs a;
    float grad_scale;
  };
  const Config configs[] = {
      {{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}, 1.0f},
      {{.lr = 3e-2f, .beta1 = 0.8f, .beta2 = 0.999f, .eps = 1e-3f, .weight_decay = 0.05f}, 1e-3f},
      {{.lr = 1e-2f, .beta1 = 0.3f, .beta2 = 0.9f, .eps = 1e-8f, .weight_decay = 0.0f}, 0.1f},
  };
  for (int64_t n : {int64_t{1}, int64_t{513}, int64_t{100003}}) {
    for (const auto& c : configs) {
      auto p = test::randn(static_cast<size_t>(n), 1);
      std::vector<float> m(static_cast<size_t>(n), 0.0f), v(static_cast<size_t>(n), 0.0f);
      RefAdamW ref{test::to_double(p), std::vector<double>(static_cast<size_t>(n), 0.0),
                   std::vector<double>(static_cast<size_t>(n), 0.0)};
      std::vector<bf16> pb(static_cast<size_t>(n));
      for (int64_t step = 1; step <= 6; ++step) {
        auto g = test::randn(static_cast<size_t>(n), 100 + step, c.grad_scale);
        auto a = c.a;
        a.step = step;
        // Alternate with and without the bf16 copy: both paths must update the same way.
        cpu::adamw_step(a, p.data(), g.data(), m.data(), v.data(), n,
                        step % 2 ? pb.data() : nullptr);
        ref.step(a, g);
        if (step % 2) {
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(pb[i].bits, float_to_bf16(p[i]).bits) << "i=" << i << " step " << step;
        }
        ASSERT_LT(max_rel(p, ref.p, 1.0), 1e-6) << "n=" << n << " step " << step;
        ASSERT_LT(max_rel(m, ref.m, 0.1 * c.grad_scale), 1e-5) << "n=" << n << " step " << step;
        ASSERT_LT(max_rel(v, ref.v, 1e-6 * c.grad_scale * c.grad_scale), 1e-5)
            << "n=" << n << " step " << step;
      }
    }
  }
}

// Elementwise: the result must not depend on the thread count.
TEST_ALL_ISAS(AdamW, ThreadCountIndependent) {
  const int64_t n = 100003;
  auto p0 = test::randn(static_cast<size_t>(n), 1), g = test::randn(static_cast<size_t>(n), 2);
  auto m0 = test::randn(static_cast<size_t>(n), 3, 0.1f),
       v0 = test::randn(static_cast<size_t>(n), 4, 0.1f);
  for (auto& x : v0) x = x * x;
  cpu::AdamWArgs a{.lr = 1e-3f, .weight_decay = 0.1f, .step = 7};
  std::vector<float> out[2];
  const int saved = omp_get_max_threads();
  for (int k = 0; k < 2; ++k) {
    omp_set_num_threads(k == 0 ? 1 : 3);
    auto p = p0, m = m0, v = v0;
    cpu::adamw_step(a, p.data(), g.data(), m.data(), v.data(), n);
    out[k] = p;
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), n * sizeof(float)), 0);
}

// grad_scale (clipping in the optimizer's pass) must give the bits of scaling the gradients in
// place first and updating with the scaled ones, with and without the bf16 copy.
TEST_ALL_ISAS(AdamW, GradScaleEqualsScalingTheGradientsFirst) {
  const int64_t n = 100003;
  const auto p0 = test::randn(static_cast<size_t>(n), 11),
             g = test::randn(static_cast<size_t>(n), 12);
  auto m0 = test::randn(static_cast<size_t>(n), 13, 0.1f),
       v0 = test::randn(static_cast<size_t>(n), 14, 0.1f);
  for (auto& x : v0) x = x * x;
  for (const float s : {0.37f, 1.0f / 3.0f, 1.0f}) {
    for (const bool with_bf16 : {false, true}) {
      auto p1 = p0, m1 = m0, v1 = v0, p2 = p0, m2 = m0, v2 = v0;
      std::vector<bf16> b1(static_cast<size_t>(n)), b2(static_cast<size_t>(n));
      auto scaled = g;
      for (auto& x : scaled) x *= s;
      cpu::AdamWArgs a{.lr = 1e-3f, .weight_decay = 0.1f, .step = 3};
      cpu::adamw_step(a, p1.data(), scaled.data(), m1.data(), v1.data(), n,
                      with_bf16 ? b1.data() : nullptr);
      a.grad_scale = s;
      cpu::adamw_step(a, p2.data(), g.data(), m2.data(), v2.data(), n,
                      with_bf16 ? b2.data() : nullptr);
      EXPECT_EQ(std::memcmp(p1.data(), p2.data(), n * sizeof(float)), 0) << "scale " << s;
      EXPECT_EQ(std::memcmp(m1.data(), m2.data(), n * sizeof(float)), 0) << "scale " << s;
      EXPECT_EQ(std::memcmp(v1.data(), v2.data(), n * sizeof(float)), 0) << "scale " << s;
      EXPECT_EQ(std::memcmp(b1.data(), b2.data(), n * sizeof(bf16)), 0) << "scale " << s;
    }
  }
}

TEST(AdamW, RejectsBadArguments) {
  float p = 1, g = 1, m = 0, v = 0;
  cpu::AdamWArgs a{.lr = 1e-3f};
  a.step = 0;
  EXPECT_THROW(cpu::adamw_step(a, &p, &g, &m, &v, 1), Error);
  a.step = 1;
  a.beta2 = 1.0f;
  EXPECT_THROW(cpu::adamw_step(a, &p, &g, &m, &v, 1), Error);
  a.beta2 = 0.95f;
  EXPECT_THROW(cpu::adamw_step(a, &p, &g, &m, &v, -1), Error);
  a = cpu::AdamWArgs{};
  for (const float s : {0.0f, -1.0f, std::nanf(""), INFINITY}) {
    a.grad_scale = s;
    EXPECT_THROW(cpu::adamw_step(a, &p, &g, &m, &v, 1), Error) << s;
  }
}
