#include "kernels/cpu/swiglu.hpp"

#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

struct Shape {
  int64_t rows, F;
};

// Gates spread wide (std 4) so sigmoid is exercised in both tails, plus a few extreme values
// where exp(-g) would overflow a naive float implementation.
std::vector<float> make_gu(int64_t rows, int64_t F, uint64_t seed) {
  auto gu = test::randn(static_cast<size_t>(rows * 2 * F), seed);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < F; ++j) gu[r * 2 * F + j] *= 4.0f;
  const float extremes[] = {-200.0f, -90.0f, -88.5f, -30.0f, 30.0f, 88.5f, 90.0f, 200.0f};
  for (int64_t k = 0; k < 8 && F >= 16; ++k) gu[k * 2 + (k % 2)] = extremes[k];
  return gu;
}

double silu(double g) {
  return g / (1.0 + std::exp(-g));
}

}  // namespace

// The f32 kernel with its own exp against fp64: measured worst case 1.7e-7 relative (3 ulp) over
// a dense sweep of g in [-80, 80], so 1e-6 relative per element (plus a 1e-30 floor for the far
// negative tail, where the clamp of exp's argument shows) and 1e-6 relative L2 hold with margin.
TEST_ALL_ISAS(SwiGLU, ForwardMatchesFp64Reference) {
  for (auto [rows, F] : std::vector<Shape>{{37, 769}, {37, 50}, {3, 1376}, {1, 1}}) {
    auto gu = make_gu(rows, F, 1);
    std::vector<float> h(static_cast<size_t>(rows * F));
    cpu::swiglu_forward(gu.data(), rows, F, h.data());
    std::vector<double> ref(h.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < F; ++j)
        ref[r * F + j] = silu(gu[r * 2 * F + j]) * double(gu[r * 2 * F + F + j]);
    EXPECT_LT(test::rel_l2(h, ref), 1e-6) << rows << "x" << F;
    for (size_t i = 0; i < h.size(); ++i) {
      ASSERT_TRUE(std::isfinite(h[i])) << i;
      ASSERT_LE(std::abs(h[i] - ref[i]), 1e-6 * std::abs(ref[i]) + 1e-30) << i;
    }
  }
}

// F = 1 runs the scalar tail only; F = 37 puts NaNs in vector lanes and in the tail.
TEST_ALL_ISAS(SwiGLU, PropagatesNaN) {
  for (int64_t F : {1, 37}) {
    std::vector<float> gu(static_cast<size_t>(2 * F), 1.0f), h(static_cast<size_t>(F));
    for (int64_t j = 0; j < F; j += 5) gu[j] = std::numeric_limits<float>::quiet_NaN();
    cpu::swiglu_forward(gu.data(), 1, F, h.data());
    for (int64_t j = 0; j < F; ++j)
      EXPECT_EQ(std::isnan(h[j]), j % 5 == 0) << "F " << F << " j " << j;
  }
}

// L = sum(h * r): the kernel's dgu (from dh = r) against fp64 central differences of the fp64
// reference over whole rows. Expected agreement ~1e-7; 1e-5 leaves margin and still catches a
// wrong sigmoid derivative (off by O(1) where |g| ~ 1).
TEST_ALL_ISAS(SwiGLU, BackwardMatchesFiniteDifferences) {
  for (auto [rows, F] : std::vector<Shape>{{5, 769}, {37, 50}}) {
    auto gu = make_gu(rows, F, 2);
    auto r = test::randn(static_cast<size_t>(rows * F), 3);
    std::vector<float> dgu(gu.size(), std::numeric_limits<float>::quiet_NaN());  // overwritten
    cpu::swiglu_backward(r.data(), gu.data(), rows, F, dgu.data());
    std::vector<double> num(gu.size());
    for (int64_t row = 0; row < rows; ++row) {
      auto loss = [&](const std::vector<double>& v) {
        double L = 0;
        for (int64_t j = 0; j < F; ++j) L += silu(v[j]) * v[F + j] * double(r[row * F + j]);
        return L;
      };
      auto g =
          test::numeric_grad(loss, test::to_double(std::vector<float>(
                                       gu.begin() + row * 2 * F, gu.begin() + (row + 1) * 2 * F)));
      std::copy(g.begin(), g.end(), num.begin() + row * 2 * F);
    }
    for (float v : dgu) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(test::rel_l2(dgu, num), 1e-5) << rows << "x" << F;
    // The gate and up halves separately, so an error in one cannot hide behind the other.
    std::vector<float> kg, ku;
    std::vector<double> ng, nu;
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t j = 0; j < F; ++j) {
        kg.push_back(dgu[row * 2 * F + j]);
        ng.push_back(num[row * 2 * F + j]);
        ku.push_back(dgu[row * 2 * F + F + j]);
        nu.push_back(num[row * 2 * F + F + j]);
      }
    EXPECT_LT(test::rel_l2(kg, ng), 1e-5) << rows << "x" << F;
    EXPECT_LT(test::rel_l2(ku, nu), 1e-5) << rows << "x" << F;
  }
}

// The model overwrites the saved gate/up with their gradient: in place must equal out of place.
TEST_ALL_ISAS(SwiGLU, BackwardInPlaceEqualsOutOfPlace) {
  const int64_t rows = 37, F = 769;
  auto gu = make_gu(rows, F, 4);
  auto r = test::randn(static_cast<size_t>(rows * F), 5);
  std::vector<float> out(gu.size());
  cpu::swiglu_backward(r.data(), gu.data(), rows, F, out.data());
  cpu::swiglu_backward(r.data(), gu.data(), rows, F, gu.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], gu[i]) << i;
}

// The bf16 output (mixed precision) is the f32 kernel's result rounded: bit for bit what
// cast_f32_to_bf16 makes of it, on every tier and for any thread count. F = 769 and 50 end rows in
// a scalar tail on every tier, 1376 in whole vectors; F = 1 is the tail alone.
TEST_ALL_ISAS(SwiGLU, Bf16OutputIsTheRoundedF32Result) {
  for (auto [rows, F] : std::vector<Shape>{{37, 769}, {5, 1376}, {37, 50}, {3, 1}}) {
    auto gu = make_gu(rows, F, 6);
    // NaN gates in vector lanes and in the tail: the rounding keeps them NaN, with the same bits.
    for (int64_t j = 3; j < F; j += 17) gu[j] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> h(static_cast<size_t>(rows * F));
    cpu::swiglu_forward(gu.data(), rows, F, h.data());
    std::vector<bf16> want(h.size());
    cpu::cast_f32_to_bf16(h.data(), want.data(), int64_t(h.size()));
    const int saved = omp_get_max_threads();
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      std::vector<bf16> h16(h.size());
      cpu::swiglu_forward(gu.data(), rows, F, h16.data());
      for (size_t i = 0; i < h16.size(); ++i)
        ASSERT_EQ(h16[i].bits, want[i].bits)
            << rows << "x" << F << " threads " << threads << " " << i;
    }
    omp_set_num_threads(saved);
  }
}

// Mixed precision saves gate/up in bf16: the bf16-input kernels are the f32 kernels on the widened
// values (exact), their outputs rounded, bit for bit, on every tier and thread count; the
// backward in place over the saved gate/up as out of place. The f32 kernels are checked against
// fp64 and finite differences above.
TEST_ALL_ISAS(SwiGLU, Bf16InputsAreTheF32KernelsOnTheWidenedValues) {
  for (auto [rows, F] : std::vector<Shape>{{37, 769}, {5, 1376}, {37, 50}, {3, 1}}) {
    auto gu32 = make_gu(rows, F, 7);
    for (int64_t j = 3; j < F; j += 17) gu32[j] = std::numeric_limits<float>::quiet_NaN();
    std::vector<bf16> gu(gu32.size());
    cpu::cast_f32_to_bf16(gu32.data(), gu.data(), int64_t(gu.size()));
    cpu::cast_bf16_to_f32(gu.data(), gu32.data(), int64_t(gu.size()));  // the exact widening
    const auto r = test::randn(static_cast<size_t>(rows * F), 8);
    std::vector<float> h(static_cast<size_t>(rows * F)), dgu(gu32.size());
    cpu::swiglu_forward(gu32.data(), rows, F, h.data());
    cpu::swiglu_backward(r.data(), gu32.data(), rows, F, dgu.data());
    std::vector<bf16> want_h(h.size()), want_dgu(dgu.size());
    cpu::cast_f32_to_bf16(h.data(), want_h.data(), int64_t(h.size()));
    cpu::cast_f32_to_bf16(dgu.data(), want_dgu.data(), int64_t(dgu.size()));
    const int saved = omp_get_max_threads();
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      std::vector<bf16> h16(h.size()), out(gu.size()), inplace = gu;
      cpu::swiglu_forward(gu.data(), rows, F, h16.data());
      cpu::swiglu_backward(r.data(), gu.data(), rows, F, out.data());
      cpu::swiglu_backward(r.data(), inplace.data(), rows, F, inplace.data());
      for (size_t i = 0; i < h16.size(); ++i)
        ASSERT_EQ(h16[i].bits, want_h[i].bits) << rows << "x" << F << " threads " << threads;
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(out[i].bits, want_dgu[i].bits) << rows << "x" << F << " threads " << threads;
        ASSERT_EQ(inplace[i].bits, want_dgu[i].bits) << rows << "x" << F << " in place";
      }
    }
    omp_set_num_threads(saved);
  }
}

// Outputs below f32's normal range: where the CPU rounds with vcvtneps2bf16 (avx512_bf16_native)
// they flush to zero, in vector lanes and the tail alike; the software rounding (the lower tiers,
// or with the instructions turned off) keeps them as the cast does. Every normal output is the
// cast's bits either way (the tests above). Both inputs: f32 gate/up, and bf16 (whose subnormal
// up values bf16 keeps) against the f32 kernel on their widened values.
TEST_ALL_ISAS(SwiGLU, Bf16RoundingOfDenormalOutputs) {
  const int64_t rows = 3, F = 37;  // two vectors and a tail on AVX-512
  std::vector<float> gu(static_cast<size_t>(rows * 2 * F));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      gu[size_t(r * 2 * F + j)] = 1.0f + 0.01f * float(j);                             // gate
      gu[size_t(r * 2 * F + F + j)] = (j % 2 ? -1.0f : 1.0f) * 1e-40f * float(j + 1);  // up
    }
  std::vector<bf16> gu16(gu.size());
  cpu::cast_f32_to_bf16(gu.data(), gu16.data(), int64_t(gu.size()));
  std::vector<float> gu_w(gu.size());
  cpu::cast_bf16_to_f32(gu16.data(), gu_w.data(), int64_t(gu.size()));
  for (const bool bf16_in : {false, true}) {
    std::vector<float> h(static_cast<size_t>(rows * F));
    cpu::swiglu_forward(bf16_in ? gu_w.data() : gu.data(), rows, F, h.data());
    for (const bool allowed : {true, false}) {
      const test::ScopedBf16Native scope(allowed);
      const bool flush = cpu::avx512_bf16_native();
      std::vector<bf16> h16(h.size());
      if (bf16_in)
        cpu::swiglu_forward(gu16.data(), rows, F, h16.data());
      else
        cpu::swiglu_forward(gu.data(), rows, F, h16.data());
      for (size_t i = 0; i < h.size(); ++i) {
        ASSERT_EQ(std::fpclassify(h[i]), FP_SUBNORMAL) << i;
        const bf16 want = flush ? float_to_bf16(std::copysign(0.0f, h[i])) : float_to_bf16(h[i]);
        ASSERT_EQ(h16[i].bits, want.bits)
            << "element " << i << " flush " << flush << " bf16 input " << bf16_in;
      }
    }
  }
}

TEST(SwiGLU, RejectsBadShapes) {
  float f = 1, g = 1;
  EXPECT_THROW(cpu::swiglu_forward(&f, 1, 0, &g), Error);
  EXPECT_THROW(cpu::swiglu_backward(&f, &f, -1, 1, &g), Error);
}
