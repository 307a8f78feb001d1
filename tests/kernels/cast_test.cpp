#include "kernels/cpu/cast.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

// The vectorized cast must give the bits of the scalar reference (round to nearest even, NaN kept
// NaN) everywhere. Every upper half is tried with the lower halves that decide rounding (below,
// at and above the tie, odd and even), plus specials, so a truncating or tie-away cast fails.
TEST_ALL_ISAS(Cast, F32ToBf16MatchesScalarRoundingBitwise) {
  std::vector<float> in;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      in.push_back(from_bits((hi << 16) | lo));
    }
  }
  for (float f : {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::quiet_NaN(),
                  from_bits(0x7f800001u), from_bits(0xff800001u)}) {
    in.push_back(f);
  }
  auto r = test::randn(1001, 7, 100.0f);
  in.insert(in.end(), r.begin(), r.end());
  std::vector<bf16> out(in.size());
  cpu::cast_f32_to_bf16(in.data(), out.data(), int64_t(in.size()));
  int64_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (out[i].bits != float_to_bf16(in[i]).bits) ++bad;
  }
  EXPECT_EQ(bad, 0);
  // Spot checks that pin the reference itself: ties go to even, NaN stays NaN.
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808000u)).bits, 0x3f80u);  // tie, even below
  EXPECT_EQ(float_to_bf16(from_bits(0x3f818000u)).bits, 0x3f82u);  // tie, odd below
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001u)).bits, 0x3f81u);  // above the tie
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(from_bits(0x7f800001u)))));
}

TEST_ALL_ISAS(Cast, Bf16ToF32IsExactForAllPatterns) {
  std::vector<bf16> in(0x10000 + 13);
  for (size_t i = 0; i < in.size(); ++i) in[i].bits = uint16_t(i * 40503u);
  std::vector<float> out(in.size());
  cpu::cast_bf16_to_f32(in.data(), out.data(), int64_t(in.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &out[i], 4);
    ASSERT_EQ(u, uint32_t(in[i].bits) << 16) << "at " << i;
  }
  // Round trip f32 -> bf16 -> f32 -> bf16 is the identity on the bf16 side.
  std::vector<bf16> back(in.size());
  cpu::cast_f32_to_bf16(out.data(), back.data(), int64_t(out.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(out[i])) continue;
    ASSERT_EQ(back[i].bits, in[i].bits) << "at " << i;
  }
}

// Against a long double sum; the relative 1e-12 bound is far below what an f32 accumulator
// (~1e-7 relative) could reach, so accumulating in float would fail. Sizes straddle the block.
TEST_ALL_ISAS(Cast, SumSquaresIsDoubleAccurateAndThreadCountIndependent) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{65537}, int64_t{1000037}}) {
    auto x = test::randn(static_cast<size_t>(n), 11 + n, 3.0f);
    long double ref = 0;
    for (float f : x) ref += (long double)f * f;
    const double got = cpu::sum_squares(x.data(), n);
    EXPECT_NEAR(got, double(ref), 1e-12 * double(ref) + 1e-300) << "n=" << n;
    const int saved = omp_get_max_threads();
    for (int t : {1, 3}) {
      omp_set_num_threads(t);
      const double again = cpu::sum_squares(x.data(), n);
      EXPECT_EQ(std::memcmp(&again, &got, sizeof(double)), 0) << "threads=" << t << " n=" << n;
    }
    omp_set_num_threads(saved);
  }
  // A value that squares beyond float range must not overflow.
  std::vector<float> big(37, 1e30f);
  EXPECT_NEAR(cpu::sum_squares(big.data(), 37), 37e60, 37e60 * 1e-6);
}

TEST_ALL_ISAS(Cast, ScaleAndAddInplaceAreExact) {
  for (int64_t n : {int64_t{1}, int64_t{513}, int64_t{100003}}) {
    auto x = test::randn(static_cast<size_t>(n), 21);
    auto y = test::randn(static_cast<size_t>(n), 22);
    auto xs = x;
    cpu::scale_inplace(xs.data(), n, -0.37f);
    auto ya = y;
    cpu::add_inplace(ya.data(), x.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(xs[i], x[i] * -0.37f) << i;
      ASSERT_EQ(ya[i], y[i] + x[i]) << i;
    }
  }
}

TEST(Cast, RejectsNegativeCount) {
  float f = 1;
  EXPECT_THROW(cpu::scale_inplace(&f, -1, 2.0f), Error);
  EXPECT_THROW(cpu::sum_squares(&f, -5), Error);
}
