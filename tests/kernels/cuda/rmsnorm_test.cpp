// The CUDA RMSNorm kernels against the CPU kernels (kernels/cpu/rmsnorm.hpp): every function on
// random inputs (never zeros), outputs filled with NaN first so that an element the kernel missed
// fails, odd shapes (1, 3, 37 and 1100 rows; dims that are no multiple of 8 or 4), unaligned
// pointers (the narrower paths), and the Llama 3.2 1B (d 2048) and Llama 3 8B (d 4096) shapes.
#include "kernels/cuda/rmsnorm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/rmsnorm.hpp"
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

class RmsNormCuda : public test::CudaTest {};

struct Rows {
  int64_t rows, dim;
};

// 1 x 7, 3 x 50: the scalar path; 3 x 36: 4-wide only; 1100 rows: more rows than dw's 512 blocks
// (3 rows each, the last block short); 2048 and 4096: Llama 3.2 1B and Llama 3 8B.
const std::vector<Rows> kShapes = {{1, 7},     {3, 50},    {3, 36},   {37, 288}, {37, 513},
                                   {37, 1000}, {1100, 96}, {4, 2048}, {3, 4096}, {5, 4098}};

constexpr float kEps = 1e-5f;
constexpr double kTol = 1e-5;  // relative L2 of f32 outputs against the CPU

std::string name(const Rows& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.dim);
}

// Rows of very different scales, some small enough that eps matters.
std::vector<float> make_x(int64_t rows, int64_t dim, uint64_t seed) {
  auto x = test::randn(size_t(rows * dim), seed);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i)
      x[size_t(r * dim + i)] *= (r % 3 == 0) ? 0.01f : float(1 + r % 5);
  return x;
}
std::vector<float> make_w(int64_t dim, uint64_t seed) {
  auto w = test::randn(size_t(dim), seed, 0.5f);
  for (auto& v : w) v += 1.0f;
  return w;
}

// GPU bf16 against the CPU's bf16, each its own f32 result rounded: the f32 results differ in the
// last bits (summation order, FMA), so a rounding may land one bf16 ulp apart, never more (the
// norm's outputs are products: no cancellation); at least 99% bit for bit equal.
void expect_bf16_near(const std::vector<bf16>& got, const std::vector<bf16>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t equal = 0, bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].bits == want[i].bits) {
      ++equal;
      continue;
    }
    const float g = bf16_to_float(got[i]);
    if (std::isnan(g) || std::abs(ordered(got[i]) - ordered(want[i])) > 1) {
      if (++bad <= 5)
        ADD_FAILURE() << what << " element " << i << ": " << g << " vs the CPU's "
                      << bf16_to_float(want[i]);
    }
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_GE(equal, got.size() * 99 / 100) << what;
}

}  // namespace

TEST_F(RmsNormCuda, ForwardF32MatchesCpu) {
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto x = make_x(s.rows, s.dim, 1);
    const auto w = make_w(s.dim, 2);
    std::vector<float> y(x.size()), rstd(size_t(s.rows));
    cpu::rmsnorm_forward(x.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    const Dev dx = dev(x), dw = dev(w), dy = nan_dev(s.rows * s.dim), dr = nan_dev(s.rows);
    cuda::rmsnorm_forward(dx.f(), dw.f(), s.rows, s.dim, kEps, dy.f(), dr.f());
    EXPECT_LE(test::rel_l2(dy.host(), y), kTol);
    EXPECT_LE(test::rel_l2(dr.host(), rstd), kTol);
  }
}

// The bf16 output: one ulp from the CPU's at most, and bit for bit the GPU's own f32 output
// rounded (the f32 and bf16 variants split and sum a row the same way).
TEST_F(RmsNormCuda, ForwardBf16MatchesCpuAndRoundsTheF32Output) {
  const test::ScopedBf16Native software(false);  // the CPU rounds as the GPU: no denormal flush
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto x = make_x(s.rows, s.dim, 3);
    const auto w = make_w(s.dim, 4);
    std::vector<bf16> y(x.size());
    std::vector<float> rstd(size_t(s.rows));
    cpu::rmsnorm_forward(x.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    const Dev dx = dev(x), dw = dev(w), dy = nan_dev(s.rows * s.dim, 0, DType::bf16),
              dr = nan_dev(s.rows), dy32 = nan_dev(s.rows * s.dim), dr32 = nan_dev(s.rows);
    cuda::rmsnorm_forward(dx.f(), dw.f(), s.rows, s.dim, kEps, dy.h(), dr.f());
    cuda::rmsnorm_forward(dx.f(), dw.f(), s.rows, s.dim, kEps, dy32.f(), dr32.f());
    const auto got = dy.host_bf16();
    expect_bf16_near(got, y, "y");
    EXPECT_LE(test::rel_l2(dr.host(), rstd), kTol);
    EXPECT_TRUE(same_bits(got, round_bf16(dy32.host()))) << "bf16 y is not the f32 y rounded";
    EXPECT_EQ(dr.host(), dr32.host());
  }
}

// The fused input rounding: x16 and the rewritten x bit for bit the CPU's (one rounding, the same
// function), y as rmsnorm_forward(bf16 y) of the rounded x on the GPU, bit for bit.
TEST_F(RmsNormCuda, ForwardRoundingInputMatchesCpu) {
  const test::ScopedBf16Native software(false);
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto x0 = make_x(s.rows, s.dim, 5);
    const auto w = make_w(s.dim, 6);
    auto x = x0;
    std::vector<bf16> x16(x.size()), y(x.size());
    std::vector<float> rstd(size_t(s.rows));
    cpu::rmsnorm_forward_rounding_input(x.data(), x16.data(), w.data(), s.rows, s.dim, kEps,
                                        y.data(), rstd.data());
    const Dev dx = dev(x0), dw = dev(w), dx16 = nan_dev(s.rows * s.dim, 0, DType::bf16),
              dy = nan_dev(s.rows * s.dim, 0, DType::bf16), dr = nan_dev(s.rows);
    cuda::rmsnorm_forward_rounding_input(dx.f(), dx16.h(), dw.f(), s.rows, s.dim, kEps, dy.h(),
                                         dr.f());
    EXPECT_TRUE(same_bits(dx16.host_bf16(), x16)) << "x16";
    EXPECT_EQ(dx.host(), x) << "x rewritten with the widened x16";
    const auto got = dy.host_bf16();
    expect_bf16_near(got, y, "y");
    EXPECT_LE(test::rel_l2(dr.host(), rstd), kTol);
    // The plain bf16-output forward of the already rounded x: the same bits.
    const Dev dy2 = nan_dev(s.rows * s.dim, 0, DType::bf16), dr2 = nan_dev(s.rows);
    cuda::rmsnorm_forward(dx.f(), dw.f(), s.rows, s.dim, kEps, dy2.h(), dr2.f());
    EXPECT_TRUE(same_bits(got, dy2.host_bf16())) << "y is not the norm of the rounded x";
    EXPECT_EQ(dr.host(), dr2.host());
  }
}

// dx and dw accumulate (as the CPU's): both start from small random values, so an overwrite
// would miss by ~1e-2 relative. dw is deterministic: a second run from the same start has the same
// bits.
TEST_F(RmsNormCuda, BackwardAccumulatesAsCpu) {
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto x = make_x(s.rows, s.dim, 7);
    const auto w = make_w(s.dim, 8);
    const auto dy = test::randn(x.size(), 9);
    const auto dx0 = test::randn(x.size(), 10, 0.01f);
    const auto dw0 = test::randn(size_t(s.dim), 11, 0.01f);
    std::vector<float> y(x.size()), rstd(size_t(s.rows));
    cpu::rmsnorm_forward(x.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    auto dx = dx0, dw = dw0;
    cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), s.rows, s.dim, dx.data(),
                          dw.data());
    const Dev d_x = dev(x), d_w = dev(w), d_dy = dev(dy), d_r = dev(rstd);
    std::vector<float> first_dx, first_dw;
    for (int run = 0; run < 2; ++run) {
      const Dev d_dx = dev(dx0), d_dw = dev(dw0);
      cuda::rmsnorm_backward(d_dy.f(), d_x.f(), d_w.f(), d_r.f(), s.rows, s.dim, d_dx.f(),
                             d_dw.f());
      const auto gdx = d_dx.host(), gdw = d_dw.host();
      EXPECT_LE(test::rel_l2(gdx, dx), kTol) << "dx";
      EXPECT_LE(test::rel_l2(gdw, dw), kTol) << "dw";
      if (run == 0) {
        first_dx = gdx;
        first_dw = gdw;
      } else {
        EXPECT_EQ(gdx, first_dx) << "dx differs between two runs";
        EXPECT_EQ(gdw, first_dw) << "dw differs between two runs";
      }
    }
  }
}

// x saved in bf16: the CPU's bf16-x kernel within tolerance, and the GPU's f32-x kernel on the
// widened x bit for bit.
TEST_F(RmsNormCuda, BackwardBf16XMatchesCpuAndTheWidenedF32) {
  for (const Rows& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto x16 = round_bf16(make_x(s.rows, s.dim, 12));
    const auto xw = widen(x16);
    const auto w = make_w(s.dim, 13);
    const auto dy = test::randn(xw.size(), 14);
    const auto dx0 = test::randn(xw.size(), 15, 0.01f);
    const auto dw0 = test::randn(size_t(s.dim), 16, 0.01f);
    std::vector<float> y(xw.size()), rstd(size_t(s.rows));
    cpu::rmsnorm_forward(xw.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    auto dx = dx0, dw = dw0;
    cpu::rmsnorm_backward(dy.data(), x16.data(), w.data(), rstd.data(), s.rows, s.dim, dx.data(),
                          dw.data());
    const Dev d_x16 = dev(xw, 0, DType::bf16), d_xw = dev(xw), d_w = dev(w), d_dy = dev(dy),
              d_r = dev(rstd);
    const Dev d_dx = dev(dx0), d_dw = dev(dw0), e_dx = dev(dx0), e_dw = dev(dw0);
    cuda::rmsnorm_backward(d_dy.f(), d_x16.h(), d_w.f(), d_r.f(), s.rows, s.dim, d_dx.f(),
                           d_dw.f());
    cuda::rmsnorm_backward(d_dy.f(), d_xw.f(), d_w.f(), d_r.f(), s.rows, s.dim, e_dx.f(), e_dw.f());
    const auto gdx = d_dx.host(), gdw = d_dw.host();
    EXPECT_LE(test::rel_l2(gdx, dx), kTol) << "dx";
    EXPECT_LE(test::rel_l2(gdw, dw), kTol) << "dw";
    EXPECT_EQ(gdx, e_dx.host()) << "dx of bf16 x differs from the f32 kernel on the widened x";
    EXPECT_EQ(gdw, e_dw.host()) << "dw of bf16 x differs from the f32 kernel on the widened x";
  }
}

// Pointers that are not 16-byte aligned (views into larger buffers), on dims that are multiples
// of 8: one element off takes the scalar path; 4 bf16 off (8 bytes) the 4-wide path with 8-byte
// bf16 accesses.
TEST_F(RmsNormCuda, UnalignedPointers) {
  const test::ScopedBf16Native software(false);
  for (const Rows& s : std::vector<Rows>{{37, 288}, {4, 2048}}) {
    SCOPED_TRACE(name(s));
    const auto x = make_x(s.rows, s.dim, 17);
    const auto w = make_w(s.dim, 18);
    const int64_t n = s.rows * s.dim;
    std::vector<float> y(x.size()), rstd(size_t(s.rows));
    cpu::rmsnorm_forward(x.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    {
      const Dev dx = dev(x, 1), dw = dev(w, 1), dy = nan_dev(n, 1), dr = nan_dev(s.rows, 1);
      cuda::rmsnorm_forward(dx.f(), dw.f(), s.rows, s.dim, kEps, dy.f(), dr.f());
      EXPECT_LE(test::rel_l2(dy.host(), y), kTol) << "f32 y, scalar";
      EXPECT_LE(test::rel_l2(dr.host(), rstd), kTol);
    }
    std::vector<bf16> y16(x.size());
    cpu::rmsnorm_forward(x.data(), w.data(), s.rows, s.dim, kEps, y16.data(), rstd.data());
    for (const int64_t off : {1, 4}) {
      const Dev dx = dev(x), dw = dev(w), dy = nan_dev(n, off, DType::bf16), dr = nan_dev(s.rows);
      cuda::rmsnorm_forward(dx.f(), dw.f(), s.rows, s.dim, kEps, dy.h(), dr.f());
      expect_bf16_near(dy.host_bf16(), y16, "bf16 y at offset " + std::to_string(off));
      // The rounding input with x16 at the same offset.
      auto xr = x;
      std::vector<bf16> x16(x.size()), yr(x.size());
      cpu::rmsnorm_forward_rounding_input(xr.data(), x16.data(), w.data(), s.rows, s.dim, kEps,
                                          yr.data(), rstd.data());
      const Dev ex = dev(x), ex16 = nan_dev(n, off, DType::bf16), ey = nan_dev(n, 0, DType::bf16);
      cuda::rmsnorm_forward_rounding_input(ex.f(), ex16.h(), dw.f(), s.rows, s.dim, kEps, ey.h(),
                                           dr.f());
      EXPECT_TRUE(same_bits(ex16.host_bf16(), x16)) << "x16 at offset " << off;
      EXPECT_EQ(ex.host(), xr);
      expect_bf16_near(ey.host_bf16(), yr,
                       "rounding-input y, x16 at offset " + std::to_string(off));
    }
    // The backward with dy one float off (scalar path), and with bf16 x 4 elements off (4-wide).
    const auto dy = test::randn(x.size(), 19);
    const auto dx0 = test::randn(x.size(), 20, 0.01f);
    const auto dw0 = test::randn(size_t(s.dim), 21, 0.01f);
    cpu::rmsnorm_forward(x.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    auto dx = dx0, dw = dw0;
    cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), s.rows, s.dim, dx.data(),
                          dw.data());
    {
      const Dev d_x = dev(x), d_w = dev(w), d_dy = dev(dy, 1), d_r = dev(rstd), d_dx = dev(dx0),
                d_dw = dev(dw0);
      cuda::rmsnorm_backward(d_dy.f(), d_x.f(), d_w.f(), d_r.f(), s.rows, s.dim, d_dx.f(),
                             d_dw.f());
      EXPECT_LE(test::rel_l2(d_dx.host(), dx), kTol) << "dx, scalar";
      EXPECT_LE(test::rel_l2(d_dw.host(), dw), kTol) << "dw, scalar";
    }
    const auto x16 = round_bf16(x);
    const auto xw = widen(x16);
    cpu::rmsnorm_forward(xw.data(), w.data(), s.rows, s.dim, kEps, y.data(), rstd.data());
    dx = dx0;
    dw = dw0;
    cpu::rmsnorm_backward(dy.data(), x16.data(), w.data(), rstd.data(), s.rows, s.dim, dx.data(),
                          dw.data());
    {
      const Dev d_x = dev(xw, 4, DType::bf16), d_w = dev(w), d_dy = dev(dy), d_r = dev(rstd),
                d_dx = dev(dx0), d_dw = dev(dw0);
      cuda::rmsnorm_backward(d_dy.f(), d_x.h(), d_w.f(), d_r.f(), s.rows, s.dim, d_dx.f(),
                             d_dw.f());
      EXPECT_LE(test::rel_l2(d_dx.host(), dx), kTol) << "dx, bf16 x 4-wide";
      EXPECT_LE(test::rel_l2(d_dw.host(), dw), kTol) << "dw, bf16 x 4-wide";
    }
  }
}

TEST_F(RmsNormCuda, NoRowsAndBadArguments) {
  const Dev x = dev({1.0f, 2.0f}), w = dev({1.0f, 1.0f}), y = dev({5.0f, 6.0f}), r = dev({7.0f});
  // No rows: nothing written, nothing thrown (dw left as it is).
  cuda::rmsnorm_forward(x.f(), w.f(), 0, 2, kEps, y.f(), r.f());
  cuda::rmsnorm_backward(x.f(), x.f(), w.f(), r.f(), 0, 2, y.f(), r.f());
  EXPECT_EQ(y.host(), (std::vector<float>{5.0f, 6.0f}));
  EXPECT_EQ(r.host(), (std::vector<float>{7.0f}));
  EXPECT_THROW(cuda::rmsnorm_forward(x.f(), w.f(), 1, 0, kEps, y.f(), r.f()), Error);
  EXPECT_THROW(cuda::rmsnorm_forward(x.f(), w.f(), -1, 2, kEps, y.f(), r.f()), Error);
  EXPECT_THROW(cuda::rmsnorm_forward(x.f(), w.f(), 1, 2, -1.0f, y.f(), r.f()), Error);
  EXPECT_THROW(cuda::rmsnorm_backward(x.f(), x.f(), w.f(), r.f(), 1, 0, y.f(), r.f()), Error);
}
