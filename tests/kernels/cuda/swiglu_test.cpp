// The CUDA SwiGLU kernels against the CPU kernels (kernels/cpu/swiglu.hpp): every variant on
// random inputs (never zeros), outputs filled with NaN first, odd shapes (1, 3, 37 rows; F not a
// multiple of 8 or 4), unaligned pointers (the scalar path), the backward in place (dgu == gu),
// and the MLPs of Llama 3.2 1B (F 8192) and Llama 3 8B (F 14336).
#include "kernels/cuda/swiglu.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

using test::Dev;
using test::dev;
using test::nan_dev;
using test::ordered;
using test::round_bf16;
using test::same_bits;
using test::widen;

class SwiGluCuda : public test::CudaTest {};

struct Rows {
  int64_t rows, F;
};

// F 5: the scalar path everywhere; 12: 4-wide for f32, scalar where bf16 takes part; 8192 and
// 14336: Llama 3.2 1B and Llama 3 8B.
const std::vector<Rows> kShapes = {{1, 5},   {3, 12},   {37, 64},  {37, 769},
                                   {3, 776}, {4, 8192}, {3, 14336}};

constexpr double kTol = 1e-5;  // relative L2 of f32 outputs against the CPU

std::string name(const Rows& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.F);
}

// Gate and up of a few units' scale: the sigmoid's saturated ends and its middle.
std::vector<float> make_gu(const Rows& s, uint64_t seed) {
  return test::randn(size_t(s.rows * 2 * s.F), seed, 2.0f);
}

// GPU bf16 against the CPU's bf16, each its own f32 result rounded (another exp, other FMAs): at
// most one bf16 ulp apart, except that an element may miss by up to atol[i] where given: the
// gate's gradient has a sum, 1 + g (1 - s), that cancels near g = -1.28, and there the f32
// results of the two agree only to a few f32 ulp of the terms (atol), not to a fraction of the
// small result's bf16 ulp. At least 99% of the elements bit for bit equal.
void expect_bf16_near(const std::vector<bf16>& got, const std::vector<bf16>& want,
                      const std::vector<double>& atol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t equal = 0, bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].bits == want[i].bits) {
      ++equal;
      continue;
    }
    const float g = bf16_to_float(got[i]), w = bf16_to_float(want[i]);
    const bool ok =
        !std::isnan(g) && (std::abs(ordered(got[i]) - ordered(want[i])) <= 1 ||
                           (!atol.empty() && std::abs(double(g) - double(w)) <= atol[i]));
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << what << " element " << i << ": " << g << " vs the CPU's " << w;
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_GE(equal, got.size() * 99 / 100) << what;
}

// The bound of the gate gradients' f32 error: 1e-6 (8 f32 ulp) of |dh u| (1 + |g|), the size of
// the terms of dh u s (1 + g (1 - s)); the up gradients (products only) get none.
std::vector<double> backward_atol(const std::vector<float>& dh, const std::vector<float>& gu,
                                  const Rows& s) {
  std::vector<double> atol(gu.size(), 0.0);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t j = 0; j < s.F; ++j) {
      const double g = gu[size_t(r * 2 * s.F + j)], u = gu[size_t(r * 2 * s.F + s.F + j)];
      atol[size_t(r * 2 * s.F + j)] =
          1e-6 * std::abs(dh[size_t(r * s.F + j)] * u) * (1 + std::abs(g));
    }
  return atol;
}

}  // namespace

TEST_F(SwiGluCuda, ForwardF32MatchesCpu) {
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto gu = make_gu(s, 1);
    std::vector<float> h(size_t(s.rows * s.F));
    cpu::swiglu_forward(gu.data(), s.rows, s.F, h.data());
    const Dev dgu = dev(gu), dh = nan_dev(s.rows * s.F);
    cuda::swiglu_forward(dgu.f(), s.rows, s.F, dh.f());
    EXPECT_LE(test::rel_l2(dh.host(), h), kTol);
  }
}

// f32 gate/up, bf16 h: one ulp from the CPU's at most, and the GPU's f32 h rounded, bit for bit.
TEST_F(SwiGluCuda, ForwardBf16OutMatchesCpu) {
  const test::ScopedBf16Native software(false);  // the CPU rounds as the GPU: no denormal flush
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto gu = make_gu(s, 2);
    std::vector<bf16> h(size_t(s.rows * s.F));
    cpu::swiglu_forward(gu.data(), s.rows, s.F, h.data());
    const Dev dgu = dev(gu), dh = nan_dev(s.rows * s.F, 0, DType::bf16),
              dh32 = nan_dev(s.rows * s.F);
    cuda::swiglu_forward(dgu.f(), s.rows, s.F, dh.h());
    cuda::swiglu_forward(dgu.f(), s.rows, s.F, dh32.f());
    const auto got = dh.host_bf16();
    expect_bf16_near(got, h, {}, "h");
    EXPECT_TRUE(same_bits(got, round_bf16(dh32.host()))) << "bf16 h is not the f32 h rounded";
  }
}

// bf16 gate/up in, bf16 h out: the CPU's bf16 kernel within one ulp, and the GPU's f32 kernel on
// the widened gate/up, rounded, bit for bit.
TEST_F(SwiGluCuda, ForwardBf16InMatchesCpu) {
  const test::ScopedBf16Native software(false);
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto gu16 = round_bf16(make_gu(s, 3));
    const auto guw = widen(gu16);
    std::vector<bf16> h(size_t(s.rows * s.F));
    cpu::swiglu_forward(gu16.data(), s.rows, s.F, h.data());
    const Dev dgu16 = dev(guw, 0, DType::bf16), dguw = dev(guw),
              dh = nan_dev(s.rows * s.F, 0, DType::bf16), dh32 = nan_dev(s.rows * s.F);
    cuda::swiglu_forward(dgu16.h(), s.rows, s.F, dh.h());
    cuda::swiglu_forward(dguw.f(), s.rows, s.F, dh32.f());
    const auto got = dh.host_bf16();
    expect_bf16_near(got, h, {}, "h");
    EXPECT_TRUE(same_bits(got, round_bf16(dh32.host())))
        << "bf16-input h is not the f32 kernel's on the widened input, rounded";
  }
}

// The f32 gradient overwrites dgu (poisoned with NaN first) and may be computed in place over gu:
// the same bits either way.
TEST_F(SwiGluCuda, BackwardF32MatchesCpuAndRunsInPlace) {
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto gu = make_gu(s, 4);
    const auto dh = test::randn(size_t(s.rows * s.F), 5);
    std::vector<float> dgu(gu.size());
    cpu::swiglu_backward(dh.data(), gu.data(), s.rows, s.F, dgu.data());
    const Dev d_gu = dev(gu), d_dh = dev(dh), d_dgu = nan_dev(int64_t(gu.size()));
    cuda::swiglu_backward(d_dh.f(), d_gu.f(), s.rows, s.F, d_dgu.f());
    const auto got = d_dgu.host();
    EXPECT_LE(test::rel_l2(got, dgu), kTol);
    EXPECT_EQ(d_gu.host(), gu) << "gu written by the out-of-place backward";
    cuda::swiglu_backward(d_dh.f(), d_gu.f(), s.rows, s.F, d_gu.f());  // in place
    EXPECT_EQ(d_gu.host(), got) << "in place differs from out of place";
  }
}

// bf16 gate/up and gradient: the CPU's within one ulp (or the cancellation bound of the gate's
// gradient), the GPU's f32 backward on the widened gate/up rounded bit for bit, and in place the
// same bits.
TEST_F(SwiGluCuda, BackwardBf16MatchesCpuAndRunsInPlace) {
  const test::ScopedBf16Native software(false);
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto gu16 = round_bf16(make_gu(s, 6));
    const auto guw = widen(gu16);
    const auto dh = test::randn(size_t(s.rows * s.F), 7);
    std::vector<bf16> dgu(gu16.size());
    cpu::swiglu_backward(dh.data(), gu16.data(), s.rows, s.F, dgu.data());
    const Dev d_gu = dev(guw, 0, DType::bf16), d_guw = dev(guw), d_dh = dev(dh),
              d_dgu = nan_dev(int64_t(guw.size()), 0, DType::bf16),
              d_dgu32 = nan_dev(int64_t(guw.size()));
    cuda::swiglu_backward(d_dh.f(), d_gu.h(), s.rows, s.F, d_dgu.h());
    cuda::swiglu_backward(d_dh.f(), d_guw.f(), s.rows, s.F, d_dgu32.f());
    const auto got = d_dgu.host_bf16();
    expect_bf16_near(got, dgu, backward_atol(dh, guw, s), "dgu");
    EXPECT_TRUE(same_bits(got, round_bf16(d_dgu32.host())))
        << "bf16 dgu is not the f32 kernel's on the widened input, rounded";
    EXPECT_TRUE(same_bits(d_gu.host_bf16(), gu16)) << "gu written by the out-of-place backward";
    cuda::swiglu_backward(d_dh.f(), d_gu.h(), s.rows, s.F, d_gu.h());  // in place
    EXPECT_TRUE(same_bits(d_gu.host_bf16(), got)) << "in place differs from out of place";
  }
}

// Pointers one element off 16-byte alignment (views into larger buffers) on shapes whose F is a
// multiple of 8: the scalar path, the same results.
TEST_F(SwiGluCuda, UnalignedPointers) {
  const test::ScopedBf16Native software(false);
  for (const Rows& s : std::vector<Rows>{{37, 64}, {3, 8192}}) {
    SCOPED_TRACE(name(s));
    const auto gu = make_gu(s, 8);
    const auto dh = test::randn(size_t(s.rows * s.F), 9);
    const int64_t nh = s.rows * s.F, ngu = 2 * nh;
    std::vector<float> h(static_cast<size_t>(nh)), dgu(gu.size());
    cpu::swiglu_forward(gu.data(), s.rows, s.F, h.data());
    cpu::swiglu_backward(dh.data(), gu.data(), s.rows, s.F, dgu.data());
    const Dev d_gu = dev(gu, 1), d_h = nan_dev(nh, 1), d_dh = dev(dh, 1), d_dgu = nan_dev(ngu, 1);
    cuda::swiglu_forward(d_gu.f(), s.rows, s.F, d_h.f());
    cuda::swiglu_backward(d_dh.f(), d_gu.f(), s.rows, s.F, d_dgu.f());
    EXPECT_LE(test::rel_l2(d_h.host(), h), kTol) << "f32 forward";
    EXPECT_LE(test::rel_l2(d_dgu.host(), dgu), kTol) << "f32 backward";

    const auto gu16 = round_bf16(gu);
    const auto guw = widen(gu16);
    std::vector<bf16> h16(static_cast<size_t>(nh)), dgu16(gu.size());
    cpu::swiglu_forward(gu16.data(), s.rows, s.F, h16.data());
    cpu::swiglu_backward(dh.data(), gu16.data(), s.rows, s.F, dgu16.data());
    const Dev e_gu = dev(guw, 1, DType::bf16), e_h = nan_dev(nh, 1, DType::bf16),
              e_dgu = nan_dev(ngu, 1, DType::bf16);
    cuda::swiglu_forward(e_gu.h(), s.rows, s.F, e_h.h());
    cuda::swiglu_backward(d_dh.f(), e_gu.h(), s.rows, s.F, e_dgu.h());
    expect_bf16_near(e_h.host_bf16(), h16, {}, "bf16 forward");
    expect_bf16_near(e_dgu.host_bf16(), dgu16, backward_atol(dh, guw, s), "bf16 backward");
  }
}

TEST_F(SwiGluCuda, NoRowsAndBadArguments) {
  const Dev gu = dev({1.0f, 2.0f}), h = dev({5.0f});
  cuda::swiglu_forward(gu.f(), 0, 1, h.f());
  cuda::swiglu_backward(h.f(), gu.f(), 0, 1, gu.f());
  EXPECT_EQ(h.host(), (std::vector<float>{5.0f}));
  EXPECT_EQ(gu.host(), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_THROW(cuda::swiglu_forward(gu.f(), 1, 0, h.f()), Error);
  EXPECT_THROW(cuda::swiglu_forward(gu.f(), -1, 1, h.f()), Error);
  EXPECT_THROW(cuda::swiglu_backward(h.f(), gu.f(), 1, 0, gu.f()), Error);
}
