// The CUDA RoPE kernels against the CPU kernels (kernels/cpu/rope.hpp): in place over strided
// rows (q inside a fused qkv buffer, odd strides that leave the 16-byte path), the fused rotation
// and rounding with copied heads, head dims whose half is no multiple of 8 or 4, the heads of
// Llama 3.2 1B (32 q / 8 kv heads of 64) and Llama 3 8B (head dim 128), and a position outside the
// table (NaN, never a read out of bounds).
#include "kernels/cuda/rope.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/rope.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

using test::ordered;
using test::round_bf16;
using test::same_bits;

class RopeCuda : public test::CudaTest {};

constexpr double kTol = 1e-5;  // relative L2 of f32 outputs against the CPU

RopeScaling llama31() {
  RopeScaling s;
  s.llama3 = true;
  s.factor = 32;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position = 8192;
  return s;
}

// B tokens' rows of T, H rotated heads and Hc copied ones (rope_rounded) of head dim D, rows
// `stride` floats apart.
struct Case {
  int64_t B, T, H, Hc, D, stride;
  std::string name() const {
    return "B" + std::to_string(B) + " T" + std::to_string(T) + " H" + std::to_string(H) + " Hc" +
           std::to_string(Hc) + " D" + std::to_string(D) + " stride" + std::to_string(stride);
  }
};

// D 6: half 3, the scalar path; D 40: half 20, 4 pairs a step; D 48, 64, 128: 8 (4 in place);
// an odd stride: rows off 16-byte alignment, the scalar path. Llama 3.2 1B: q, k, v of 32 + 8 + 8
// heads of 64 in one fused row (stride 3072), q and k rotated (H 40), v copied (Hc 8); the kv
// heads alone (8 + 8); Llama 3 8B: the same with heads of 128 (stride 6144).
const std::vector<Case> kCases = {
    {1, 1, 1, 1, 6, 12},    {3, 7, 5, 2, 6, 45},      {2, 5, 3, 1, 40, 160},
    {3, 8, 5, 2, 64, 451},  {2, 6, 4, 2, 48, 288},    {2, 8, 40, 8, 64, 3072},
    {1, 8, 8, 8, 64, 1024}, {1, 5, 40, 8, 128, 6144}, {2, 3, 8, 8, 128, 2048}};

constexpr int64_t kPositions = 30000;

// Positions: the table's ends and some in between.
std::vector<int32_t> make_positions(int64_t T, uint64_t seed) {
  std::vector<int32_t> p(static_cast<size_t>(T));
  const auto r = test::randn(size_t(T), seed);
  for (int64_t t = 0; t < T; ++t)
    p[size_t(t)] = int32_t(std::abs(double(r[size_t(t)])) * 9000) % int32_t(kPositions);
  p[0] = int32_t(kPositions - 1);
  if (T > 1) p[1] = 0;
  return p;
}

// The table on the device, as RopeTable's vectors.
struct DeviceTable {
  Tensor cos, sin;
  cuda::RopeDeviceTable view;
};
DeviceTable upload(const RopeTable& t) {
  DeviceTable d{test::to_device(t.cos), test::to_device(t.sin), {}};
  d.view = {d.cos.data<float>(), d.sin.data<float>(), t.head_dim, t.num_positions};
  return d;
}

// GPU bf16 against the CPU's bf16, each its own f32 result rounded: at most one bf16 ulp apart,
// or within atol[i]: x1 c - x2 s cancels where the two products nearly meet, and there the f32
// results (nvcc and GCC fuse different products into FMAs) agree to a few f32 ulp of the terms
// only. At least 99% of the elements bit for bit equal.
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
    const bool ok = !std::isnan(g) && (std::abs(ordered(got[i]) - ordered(want[i])) <= 1 ||
                                       std::abs(double(g) - double(w)) <= atol[i]);
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << what << " element " << i << ": " << g << " vs the CPU's " << w;
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_GE(equal, got.size() * 99 / 100) << what;
}

// Per output element of rope_rounded (rows of (H+Hc)*D): 1e-6 (8 f32 ulp) of |x1| + |x2| for a
// rotated element (|cos|, |sin| <= 1), 0 for a copied one.
std::vector<double> rounded_atol(const std::vector<float>& x, const Case& c) {
  const int64_t W = (c.H + c.Hc) * c.D, half = c.D / 2;
  std::vector<double> atol(size_t(c.B * c.T * W), 0.0);
  for (int64_t r = 0; r < c.B * c.T; ++r)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const float* p = x.data() + r * c.stride + h * c.D;
        const double a = 1e-6 * (std::abs(p[i]) + std::abs(p[i + half]));
        atol[size_t(r * W + h * c.D + i)] = atol[size_t(r * W + h * c.D + i + half)] = a;
      }
  return atol;
}

}  // namespace

// In place over strided rows: the rotated heads as the CPU's, everything else in the rows (the
// stride's gap, the heads after H) untouched, bit for bit.
TEST_F(RopeCuda, ForwardAndBackwardMatchCpu) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name());
    const auto table = cpu::rope_table(c.D, kPositions, 500000.0, llama31());
    const DeviceTable dt = upload(table);
    const auto pos = make_positions(c.T, 1);
    const Tensor dpos = test::to_device_i32(pos);
    const auto x0 = test::randn(size_t(c.B * c.T * c.stride), 2, 3.0f);
    for (const bool backward : {false, true}) {
      SCOPED_TRACE(backward ? "backward" : "forward");
      auto x = x0;
      (backward ? cpu::rope_backward : cpu::rope_forward)(x.data(), c.B, c.T, c.H, c.D, c.stride,
                                                          pos.data(), table);
      Tensor dx = test::to_device(x0);
      (backward ? cuda::rope_backward : cuda::rope_forward)(
          dx.data<float>(), c.B, c.T, c.H, c.D, c.stride, dpos.data<int32_t>(), dt.view);
      const auto got = test::to_host(dx);
      EXPECT_LE(test::rel_l2(got, x), kTol);
      size_t touched = 0;
      for (int64_t r = 0; r < c.B * c.T; ++r)
        for (int64_t j = c.H * c.D; j < c.stride; ++j) {
          const size_t k = size_t(r * c.stride + j);
          touched += std::memcmp(&got[k], &x0[k], sizeof(float)) != 0;
        }
      EXPECT_EQ(touched, 0u) << "elements past the H rotated heads were written";
    }
    // Backward after forward: the rotation undone (to f32 rounding).
    Tensor dx = test::to_device(x0);
    cuda::rope_forward(dx.data<float>(), c.B, c.T, c.H, c.D, c.stride, dpos.data<int32_t>(),
                       dt.view);
    cuda::rope_backward(dx.data<float>(), c.B, c.T, c.H, c.D, c.stride, dpos.data<int32_t>(),
                        dt.view);
    EXPECT_LE(test::rel_l2(test::to_host(dx), x0), 1e-6);
  }
}

// The fused rotation and rounding into a bf16 output (NaN first): the CPU's within one ulp (or
// the cancellation bound), the copied heads bit for bit x rounded, and bit for bit the GPU's own
// in-place rotation rounded; x left as it was. The output contiguous, or strided (a gap of 8,
// 16-byte aligned rows; of 1, the scalar path).
TEST_F(RopeCuda, RoundedMatchesCpuAndTheInPlaceRotation) {
  const test::ScopedBf16Native software(false);  // the CPU rounds as the GPU: no denormal flush
  for (const Case& c : kCases) {
    for (const int64_t gap : {0, 8, 1}) {
      SCOPED_TRACE(c.name() + " out gap " + std::to_string(gap));
      const auto table = cpu::rope_table(c.D, kPositions, 500000.0, llama31());
      const DeviceTable dt = upload(table);
      const auto pos = make_positions(c.T, 3);
      const Tensor dpos = test::to_device_i32(pos);
      const auto x = test::randn(size_t(c.B * c.T * c.stride), 4, 3.0f);
      const int64_t W = (c.H + c.Hc) * c.D, os = W + gap, rows = c.B * c.T;
      const Tensor dx = test::to_device(x);
      for (const bool backward : {false, true}) {
        SCOPED_TRACE(backward ? "backward" : "forward");
        std::vector<bf16> want(size_t(rows * W));
        cpu::rope_rounded(x.data(), c.B, c.T, c.H, c.Hc, c.D, c.stride, pos.data(), table, backward,
                          want.data(), W);
        Tensor dout = test::nan_device(rows * os, DType::bf16);
        cuda::rope_rounded(dx.data<float>(), c.B, c.T, c.H, c.Hc, c.D, c.stride,
                           dpos.data<int32_t>(), dt.view, backward, dout.data<bf16>(), os);
        const auto all = test::to_host_bf16(dout);
        std::vector<bf16> got(size_t(rows * W));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < W; ++j) got[size_t(r * W + j)] = all[size_t(r * os + j)];
        expect_bf16_near(got, want, rounded_atol(x, c), "out");
        EXPECT_EQ(test::to_host(dx), x) << "x written";
        // The GPU's own rotation in place, then rounded: the same bits.
        Tensor dr = test::to_device(x);
        (backward ? cuda::rope_backward : cuda::rope_forward)(
            dr.data<float>(), c.B, c.T, c.H, c.D, c.stride, dpos.data<int32_t>(), dt.view);
        const auto rotated = test::to_host(dr);
        std::vector<float> rows_of(size_t(rows * W));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < W; ++j)
            rows_of[size_t(r * W + j)] = rotated[size_t(r * c.stride + j)];
        EXPECT_TRUE(same_bits(got, round_bf16(rows_of)))
            << "not the in-place rotation rounded (the copied heads: x rounded)";
      }
    }
  }
}

// A position outside the table is never looked up: that token's rotated heads become NaN (the
// caller checks positions on the host; this is the guard), the other tokens are rotated as usual.
TEST_F(RopeCuda, PositionOutsideTheTableGivesNaN) {
  const int64_t B = 2, T = 3, H = 2, Hc = 1, D = 8, P = 10, W = (H + Hc) * D;
  const auto table = cpu::rope_table(D, P, 10000.0, RopeScaling{});
  const DeviceTable dt = upload(table);
  const std::vector<int32_t> good = {3, 4, 5}, bad = {3, int32_t(P), 5};
  const Tensor dgood = test::to_device_i32(good), dbad = test::to_device_i32(bad);
  const auto x = test::randn(size_t(B * T * W), 5);
  Tensor a = test::to_device(x), b = test::to_device(x);
  cuda::rope_forward(a.data<float>(), B, T, H, D, W, dgood.data<int32_t>(), dt.view);
  cuda::rope_forward(b.data<float>(), B, T, H, D, W, dbad.data<int32_t>(), dt.view);
  const auto ga = test::to_host(a), gb = test::to_host(b);
  Tensor o = test::nan_device(B * T * W, DType::bf16);
  cuda::rope_rounded(test::to_device(x).data<float>(), B, T, H, Hc, D, W, dbad.data<int32_t>(),
                     dt.view, false, o.data<bf16>(), W);
  const auto go = test::to_host(o);
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t j = 0; j < W; ++j) {
      const size_t k = size_t(r * W + j);
      if (r % T == 1 && j < H * D) {
        EXPECT_TRUE(std::isnan(gb[k])) << "row " << r << " element " << j;
        EXPECT_TRUE(std::isnan(go[k])) << "rounded: row " << r << " element " << j;
      } else {
        EXPECT_EQ(gb[k], ga[k]) << "row " << r << " element " << j;
        EXPECT_FALSE(std::isnan(go[k])) << "rounded: row " << r << " element " << j;
      }
    }
}

TEST_F(RopeCuda, BadArguments) {
  const auto table = cpu::rope_table(8, 10, 10000.0, RopeScaling{});
  const DeviceTable dt = upload(table);
  const Tensor pos = test::to_device_i32({3, 4});
  Tensor x = test::to_device(std::vector<float>(2 * 16, 1.0f));
  Tensor out = test::nan_device(2 * 16, DType::bf16);
  float* xp = x.data<float>();
  const int32_t* pp = pos.data<int32_t>();
  EXPECT_THROW(cuda::rope_forward(xp, 1, 2, 1, 16, 16, pp, dt.view), Error);      // D vs the table
  EXPECT_THROW(cuda::rope_forward(xp, 1, 2, 2, 8, 15, pp, dt.view), Error);       // row stride
  EXPECT_THROW(cuda::rope_backward(xp, 1, -2, 1, 8, 16, pp, dt.view), Error);     // T
  EXPECT_THROW(cuda::rope_forward(xp, 1, 2, 1, 8, 16, nullptr, dt.view), Error);  // positions
  bf16* op = out.data<bf16>();
  EXPECT_THROW(cuda::rope_rounded(xp, 1, 2, 1, 1, 8, 16, pp, dt.view, false, op, 15),
               Error);  // out stride
  EXPECT_THROW(cuda::rope_rounded(xp, 1, 2, 1, -1, 8, 16, pp, dt.view, false, op, 16),
               Error);  // Hc
  EXPECT_THROW(cuda::rope_rounded(xp, 1, 2, 2, 1, 8, 16, pp, dt.view, true, op, 24),
               Error);  // x stride
  // Nothing to do: no tokens, or no heads.
  cuda::rope_forward(xp, 0, 2, 1, 8, 16, pp, dt.view);
  cuda::rope_forward(xp, 1, 2, 0, 8, 16, pp, dt.view);
  EXPECT_EQ(test::to_host(x), std::vector<float>(2 * 16, 1.0f));
}
