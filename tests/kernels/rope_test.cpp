#include "kernels/cpu/rope.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// Independent fp64 reference, written from the HF formulas (no table).
std::vector<double> naive_rope(const std::vector<double>& x, int64_t B, int64_t T, int64_t H,
                               int64_t D, int64_t row_stride, const std::vector<int32_t>& pos,
                               const std::vector<double>& inv_freq, int sign = 1) {
  std::vector<double> y = x;
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const double a = double(pos[t]) * inv_freq[i];
          const double c = std::cos(a), s = sign * std::sin(a);
          const int64_t o = (b * T + t) * row_stride + h * D;
          y[o + i] = x[o + i] * c - x[o + i + half] * s;
          y[o + i + half] = x[o + i + half] * c + x[o + i] * s;
        }
  return y;
}

std::vector<double> plain_inv_freq(int64_t D, double theta) {
  std::vector<double> f(D / 2);
  for (int64_t i = 0; i < D / 2; ++i) f[i] = 1.0 / std::pow(theta, double(2 * i) / double(D));
  return f;
}

cpu::RopeScaling llama31() {
  cpu::RopeScaling s;
  s.llama3 = true;
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position = 8192;
  return s;
}

// The Llama 3.1 scaling at a few indices, each worked out by hand for D=128, theta=500000:
// f_i = 500000^(-i/64), wavelen_i = 2*pi/f_i; high_freq_wavelen = 8192/4 = 2048,
// low_freq_wavelen = 8192/1 = 8192.
TEST(Rope, InvFreqLlama3Regimes) {
  const auto f = cpu::rope_inv_freq(128, 500000.0, llama31());
  ASSERT_EQ(f.size(), 64u);
  // i = 0: f = 1, wavelen = 2*pi < 2048: kept.
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  // i = 20: f = 500000^(-20/64) = 0.0165604, wavelen = 379.41 < 2048: kept.
  EXPECT_NEAR(f[20], 0.0165604, 1e-7);
  EXPECT_DOUBLE_EQ(f[20], std::pow(500000.0, -20.0 / 64.0));
  // i = 40: f = 500000^(-40/64) = 2.74248e-4, wavelen = 22910.6 > 8192: f / 8 = 3.42810e-5.
  EXPECT_NEAR(f[40], 3.42810e-5, 1e-10);
  EXPECT_DOUBLE_EQ(f[40], std::pow(500000.0, -40.0 / 64.0) / 8.0);
  // i = 32: f = 500000^(-1/2) = 1/707.107 = 1.41421e-3, wavelen = 4442.88 in [2048, 8192]:
  // smooth = (8192/4442.88 - 1)/(4 - 1) = 0.281283, f' = (1 - smooth) f/8 + smooth f
  //        = 0.718717 * 1.76777e-4 + 0.281283 * 1.41421e-3 = 5.24846e-4.
  EXPECT_NEAR(f[32], 5.24846e-4, 1e-9);
  const double f32 = 1.0 / std::sqrt(500000.0), w = 2 * std::numbers::pi / f32;
  const double smooth = (8192.0 / w - 1.0) / 3.0;
  EXPECT_NEAR(smooth, 0.281283, 1e-6);
  EXPECT_DOUBLE_EQ(f[32], (1 - smooth) * f32 / 8 + smooth * f32);
  // Without scaling the frequencies are plain theta^(-2i/D).
  const auto g = cpu::rope_inv_freq(128, 500000.0, cpu::RopeScaling{});
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(g[i], plain_inv_freq(128, 500000.0)[i], 1e-15 * g[0]);
  // Monotone non-increasing after scaling (the smooth region interpolates between the two ends).
  for (int i = 1; i < 64; ++i) EXPECT_LE(f[i], f[i - 1]) << i;
}

struct RopeCase {
  int64_t B, T, H, D, row_stride;
  double theta;
  bool llama3;
  std::vector<int32_t> pos;
};

std::vector<int32_t> iota_pos(int64_t T, int32_t start = 0) {
  std::vector<int32_t> p(T);
  for (int64_t t = 0; t < T; ++t) p[t] = start + int32_t(t);
  return p;
}

std::vector<RopeCase> cases() {
  return {
      {2, 7, 3, 64, 3 * 64, 10000.0, false, iota_pos(7)},
      {2, 5, 2, 48, 2 * 48 + 7, 10000.0, false, iota_pos(5, 100)},  // strided rows
      // Llama 3.1 scaling at large and non-contiguous positions.
      {1, 6, 2, 128, 2 * 128, 500000.0, true, {0, 19999, 3, 8191, 12345, 17}},
      {2, 4, 3, 128, 3 * 128 + 5, 500000.0, true, {20000, 1, 5000, 9000}},
  };
}

TEST(Rope, ForwardMatchesNaive) {
  for (const RopeCase& c : cases()) {
    cpu::RopeScaling sc = c.llama3 ? llama31() : cpu::RopeScaling{};
    const auto table = cpu::rope_table(c.D, 20001, c.theta, sc);
    const int64_t n = c.B * c.T * c.row_stride;
    const std::vector<float> x0 = test::randn(n, 42 + c.D);
    const auto ref = naive_rope(test::to_double(x0), c.B, c.T, c.H, c.D, c.row_stride, c.pos,
                                cpu::rope_inv_freq(c.D, c.theta, sc));
    test::for_each_isa([&](cpu::Isa) {
      std::vector<float> x = x0;
      cpu::rope_forward(x.data(), c.B, c.T, c.H, c.D, c.row_stride, c.pos.data(), table);
      // Tables are float: cos/sin of angles up to 2e4 rad rounded to 6e-8 relative; per element
      // that is ~1e-7 absolute on O(1) inputs.
      EXPECT_LT(test::max_abs_diff(x, ref), 2e-6) << "D=" << c.D << " llama3=" << c.llama3;
      // The gap at the end of each strided row is not touched.
      for (int64_t r = 0; r < c.B * c.T; ++r)
        for (int64_t e = c.H * c.D; e < c.row_stride; ++e)
          ASSERT_EQ(x[r * c.row_stride + e], x0[r * c.row_stride + e]);
    });
  }
  // The scaled case really differs from the unscaled one at long range (else the test is blind
  // to the scaling).
  const auto plain = cpu::rope_table(128, 20001, 500000.0, cpu::RopeScaling{});
  const auto scaled = cpu::rope_table(128, 20001, 500000.0, llama31());
  double diff = 0;
  for (size_t i = 0; i < plain.cos.size(); ++i)
    diff = std::max(diff, double(std::abs(plain.cos[i] - scaled.cos[i])));
  EXPECT_GT(diff, 0.5);
}

// Backward is the transpose of forward: for L = sum(rope(x) * r), dL/dx = rope_backward(r).
TEST(Rope, BackwardMatchesFiniteDifferences) {
  for (const RopeCase& c : cases()) {
    cpu::RopeScaling sc = c.llama3 ? llama31() : cpu::RopeScaling{};
    const auto table = cpu::rope_table(c.D, 20001, c.theta, sc);
    const auto inv = cpu::rope_inv_freq(c.D, c.theta, sc);
    const int64_t n = c.B * c.T * c.row_stride;
    const std::vector<float> x = test::randn(n, 7 + c.D);
    const std::vector<float> r = test::randn(n, 8 + c.D);
    auto f = [&](const std::vector<double>& xd) {
      const auto y = naive_rope(xd, c.B, c.T, c.H, c.D, c.row_stride, c.pos, inv);
      double L = 0;
      for (int64_t i = 0; i < n; ++i) L += y[i] * r[i];
      return L;
    };
    auto num = test::numeric_grad(f, test::to_double(x), 1e-4);
    // Gap elements are not inputs of the rotation: their gradient is the incoming one, which
    // rope_backward leaves in place (it only rotates).
    for (int64_t row = 0; row < c.B * c.T; ++row)
      for (int64_t e = c.H * c.D; e < c.row_stride; ++e)
        num[row * c.row_stride + e] = r[row * c.row_stride + e];
    test::for_each_isa([&](cpu::Isa) {
      std::vector<float> g = r;
      cpu::rope_backward(g.data(), c.B, c.T, c.H, c.D, c.row_stride, c.pos.data(), table);
      // The loss is linear, so central differences are exact up to fp64 rounding; the float
      // table bounds the error at ~1e-7 relative.
      EXPECT_LT(test::rel_l2(g, num), 1e-6) << "D=" << c.D << " llama3=" << c.llama3;
    });
  }
}

TEST_ALL_ISAS(Rope, ForwardThenBackwardIsIdentity) {
  const auto table = cpu::rope_table(64, 30000, 500000.0, llama31());
  const std::vector<int32_t> pos = {29999, 0, 17, 4096, 8192, 12000, 5, 25000};
  std::vector<float> x = test::randn(3 * 8 * 4 * 64, 9);
  const std::vector<float> x0 = x;
  cpu::rope_forward(x.data(), 3, 8, 4, 64, 4 * 64, pos.data(), table);
  EXPECT_GT(test::max_abs_diff(x, x0), 0.1);  // it did rotate
  cpu::rope_backward(x.data(), 3, 8, 4, 64, 4 * 64, pos.data(), table);
  EXPECT_LT(test::max_abs_diff(x, x0), 1e-5);
  // Rotation preserves the norm of every (i, i + D/2) pair.
  std::vector<float> y = x0;
  cpu::rope_forward(y.data(), 3, 8, 4, 64, 4 * 64, pos.data(), table);
  for (int64_t o = 0; o < int64_t(y.size()); o += 64)
    for (int i = 0; i < 32; ++i) {
      const double n0 = std::hypot(x0[o + i], x0[o + i + 32]);
      const double n1 = std::hypot(y[o + i], y[o + i + 32]);
      ASSERT_NEAR(n0, n1, 1e-5 * (1 + n0));
    }
}

// Mixed precision's fused rotation and rounding: the bits of rope_forward (rope_backward) on the
// rotated heads and a cast of every element, x untouched; strided input rows, copied heads (v)
// after the rotated ones (q, k), a head dim whose half is no multiple of any vector width.
TEST_ALL_ISAS(Rope, RoundedEqualsRotatingThenCasting) {
  for (const int64_t D : {64, 48, 6}) {
    const int64_t B = 3, T = 8, H = 5, Hc = 2, stride = (H + Hc) * D + 3;
    const auto table = cpu::rope_table(D, 30000, 500000.0, llama31());
    const std::vector<int32_t> pos = {29999, 0, 17, 4096, 8192, 12000, 5, 25000};
    const std::vector<float> x0 = test::randn(size_t(B * T * stride), 21, 3.0f);
    for (const bool backward : {false, true}) {
      std::vector<float> x = x0;
      std::vector<bf16> got(size_t(B * T * (H + Hc) * D)), want(got.size());
      cpu::rope_rounded(x.data(), B, T, H, Hc, D, stride, pos.data(), table, backward, got.data(),
                        (H + Hc) * D);
      ASSERT_EQ(x, x0) << "x must be left as it was";
      (backward ? cpu::rope_backward : cpu::rope_forward)(x.data(), B, T, H, D, stride, pos.data(),
                                                          table);
      for (int64_t r = 0; r < B * T; ++r)
        for (int64_t j = 0; j < (H + Hc) * D; ++j)
          want[size_t(r * (H + Hc) * D + j)] = float_to_bf16(x[size_t(r * stride + j)]);
      int64_t rotated = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].bits, want[i].bits) << "D " << D << " element " << i;
        rotated +=
            got[i].bits != float_to_bf16(x0[i / ((H + Hc) * D) * stride + i % ((H + Hc) * D)]).bits;
      }
      EXPECT_GT(rotated, int64_t(got.size()) / 4);  // it did rotate
    }
  }
  std::vector<float> x(2 * 16, 1.0f);
  std::vector<bf16> out(2 * 16);
  const auto table = cpu::rope_table(8, 10, 10000.0, cpu::RopeScaling{});
  const std::vector<int32_t> pos = {3, 4};
  EXPECT_THROW(
      cpu::rope_rounded(x.data(), 1, 2, 1, 1, 8, 16, pos.data(), table, false, out.data(), 15),
      Error);  // out stride
  EXPECT_THROW(
      cpu::rope_rounded(x.data(), 1, 2, 1, -1, 8, 16, pos.data(), table, false, out.data(), 16),
      Error);  // Hc
  EXPECT_THROW(
      cpu::rope_rounded(x.data(), 1, 2, 2, 1, 8, 16, pos.data(), table, true, out.data(), 24),
      Error);  // x stride
}

// Outputs below f32's normal range: flushed to zero where vcvtneps2bf16 rounds them
// (avx512_bf16_native), in every kind of lane (whole vectors at D 64, 8-lane halves at D 48, the
// scalar tail at D 6, the copied heads); kept as the cast keeps them by the software rounding.
TEST_ALL_ISAS(Rope, RoundedDenormalOutputs) {
  for (const int64_t D : {64, 48, 6}) {
    const int64_t B = 1, T = 4, H = 2, Hc = 1, W = (H + Hc) * D;
    const auto table = cpu::rope_table(D, 100, 500000.0, llama31());
    const std::vector<int32_t> pos = {0, 1, 7, 99};
    std::vector<float> x = test::randn(size_t(B * T * W), 22);
    for (float& v : x) v = v * 1e-40f + (v < 0 ? -1e-41f : 1e-41f);  // subnormal, never zero
    std::vector<float> rotated = x;
    cpu::rope_forward(rotated.data(), B, T, H, D, W, pos.data(), table);
    for (bool allowed : {true, false}) {
      const test::ScopedBf16Native scope(allowed);
      const bool flush = cpu::avx512_bf16_native();
      std::vector<bf16> got(x.size());
      cpu::rope_rounded(x.data(), B, T, H, Hc, D, W, pos.data(), table, false, got.data(), W);
      for (size_t i = 0; i < got.size(); ++i) {
        const float v = rotated[i];
        const bf16 want = flush && std::fpclassify(v) == FP_SUBNORMAL
                              ? float_to_bf16(std::copysign(0.0f, v))
                              : float_to_bf16(v);
        ASSERT_EQ(got[i].bits, want.bits) << "D " << D << " element " << i << " flush " << flush;
      }
    }
  }
}

TEST(Rope, RejectsBadInput) {
  const auto table = cpu::rope_table(16, 10, 10000.0, cpu::RopeScaling{});
  std::vector<float> x(2 * 16, 1.0f);
  std::vector<int32_t> pos = {3, 10};  // 10 is past the table
  EXPECT_THROW(cpu::rope_forward(x.data(), 1, 2, 1, 16, 16, pos.data(), table), Error);
  pos = {3, 4};
  EXPECT_THROW(cpu::rope_forward(x.data(), 1, 2, 1, 8, 16, pos.data(), table), Error);   // D
  EXPECT_THROW(cpu::rope_forward(x.data(), 1, 2, 2, 16, 16, pos.data(), table), Error);  // stride
  EXPECT_THROW(cpu::rope_inv_freq(15, 10000.0, cpu::RopeScaling{}), Error);
  cpu::RopeScaling bad = llama31();
  bad.high_freq_factor = bad.low_freq_factor;
  EXPECT_THROW(cpu::rope_inv_freq(128, 500000.0, bad), Error);
  try {
    pos = {3, 10};
    cpu::rope_backward(x.data(), 1, 2, 1, 16, 16, pos.data(), table);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the table"), std::string::npos) << e.what();
  }
}

}  // namespace
