// Casts, the element-wise passes and the deterministic sum of squares against the CPU kernels
// (kernels/cpu/cast.hpp), and AdamW against cpu::adamw_step.
#include "kernels/cuda/cast.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/adamw.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cuda/adamw.hpp"
#include "kernels/cuda/scratch.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

namespace loom::cuda {
namespace {

using test::randn;

class CudaCast : public test::CudaTest {};

// Values of every kind the rounding meets: normal, ties, denormals, infinities, NaNs.
std::vector<float> awkward_values(size_t n, uint64_t seed) {
  std::vector<float> v = randn(n, seed, 3.0f);
  const float specials[] = {0.0f,
                            -0.0f,
                            1.00390625f,  // a tie: 1 + 2^-8
                            1.01171875f,  // a tie rounding up: 1 + 3 * 2^-8
                            std::numeric_limits<float>::denorm_min(),
                            -1e-39f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            3.4e38f};
  for (size_t i = 0; i < std::size(specials) && i * 7 < n; ++i) v[i * 7] = specials[i];
  return v;
}

TEST_F(CudaCast, RoundsAsTheCpuEngineBitForBit) {
  // 8k + 5 elements from an offset of 1: the unaligned scalar path; from 0: the vector path and
  // a tail.
  for (int64_t offset : {0, 1}) {
    const int64_t n = 8 * 1000 + 5;
    const std::vector<float> x = awkward_values(size_t(n + offset), 3);
    Tensor dx = test::to_device(x);
    Tensor dy = test::nan_device(n + offset, DType::bf16);
    cast_f32_to_bf16(dx.data<float>() + offset, dy.data<bf16>() + offset, n);
    const std::vector<bf16> got = test::to_host_bf16(dy);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = float_to_bf16(x[size_t(i + offset)]).bits;
      ASSERT_EQ(got[size_t(i + offset)].bits, want) << "element " << i << " offset " << offset;
    }
    // And back: widening is exact.
    Tensor back = test::nan_device(n + offset);
    cast_bf16_to_f32(dy.data<bf16>() + offset, back.data<float>() + offset, n);
    const std::vector<float> wide = test::to_host(back);
    for (int64_t i = 0; i < n; ++i) {
      const float want = bf16_to_float(got[size_t(i + offset)]);
      if (std::isnan(want))
        ASSERT_TRUE(std::isnan(wide[size_t(i + offset)]));
      else
        ASSERT_EQ(wide[size_t(i + offset)], want) << "element " << i;
    }
  }
}

TEST_F(CudaCast, FillScaleAdd) {
  const int64_t n = 12345;
  std::vector<float> x = randn(size_t(n), 1), y = randn(size_t(n), 2);
  Tensor dx = test::to_device(x), dy = test::to_device(y);
  scale_inplace(dx.data<float>(), n, 0.75f);
  add_inplace(dy.data<float>(), dx.data<float>(), n);
  cpu::scale_inplace(x.data(), n, 0.75f);
  cpu::add_inplace(y.data(), x.data(), n);
  EXPECT_EQ(test::to_host(dx), x);
  EXPECT_EQ(test::to_host(dy), y);
  fill(dx.data<float>(), n, -2.5f);
  for (float v : test::to_host(dx)) ASSERT_EQ(v, -2.5f);
}

TEST_F(CudaCast, SumOfSquaresIsDeterministicAndMatchesTheCpu) {
  for (int64_t n : {int64_t(1), int64_t(8191), int64_t(8193), int64_t(1) << 20}) {
    const std::vector<float> x = randn(size_t(n), uint64_t(n));
    Tensor dx = test::to_device(x);
    // Doubles in device tensors of twice as many 4-byte elements.
    Tensor scratch = Tensor::empty({2 * sum_squares_parts(n)}, DType::i32, Device::cuda);
    Tensor s1 = Tensor::empty({2}, DType::i32, Device::cuda);
    Tensor s2 = Tensor::empty({2}, DType::i32, Device::cuda);
    sum_squares(dx.data<float>(), n, static_cast<double*>(scratch.raw()),
                static_cast<double*>(s1.raw()));
    sum_squares(dx.data<float>(), n, static_cast<double*>(scratch.raw()),
                static_cast<double*>(s2.raw()));
    Tensor h1 = Tensor::empty({2}, DType::i32), h2 = Tensor::empty({2}, DType::i32);
    h1.copy_from(s1);
    h2.copy_from(s2);
    double a = 0, b = 0;
    std::memcpy(&a, h1.raw(), 8);
    std::memcpy(&b, h2.raw(), 8);
    EXPECT_EQ(a, b) << "two runs differ at n=" << n;
    const double want = cpu::sum_squares(x.data(), n);
    EXPECT_NEAR(a, want, 1e-12 * want) << "n=" << n;
  }
}

class CudaAdamW : public test::CudaTest {};

TEST_F(CudaAdamW, StepsMatchTheCpu) {
  // Unaligned (offset 1) and aligned, with and without the bf16 copy, a clipping scale and both
  // lerp forms (beta1 0.9: weight 0.1; beta1 0.3: weight 0.7).
  for (int64_t offset : {0, 1})
    for (bool with_bf16 : {false, true})
      for (float beta1 : {0.9f, 0.3f}) {
        const int64_t n = 4099;
        std::vector<float> p = randn(size_t(n + offset), 1), m = randn(size_t(n + offset), 3, 0.1f),
                           v = randn(size_t(n + offset), 4, 0.01f);
        for (float& x : v) x = x * x;
        Tensor dp = test::to_device(p), dm = test::to_device(m), dv = test::to_device(v);
        Tensor db = test::nan_device(n + offset, DType::bf16);
        std::vector<bf16> pb(size_t(n + offset));
        cpu::AdamWArgs a;
        a.lr = 3e-3f, a.beta1 = beta1, a.weight_decay = 0.1f, a.grad_scale = 0.5f;
        for (int64_t step = 1; step <= 3; ++step) {
          a.step = step;
          const std::vector<float> g = randn(size_t(n + offset), 10 + uint64_t(step));
          Tensor dg = test::to_device(g);
          cpu::adamw_step(a, p.data() + offset, g.data() + offset, m.data() + offset,
                          v.data() + offset, n, with_bf16 ? pb.data() + offset : nullptr);
          cuda::adamw_step(a, dp.data<float>() + offset, dg.data<float>() + offset,
                           dm.data<float>() + offset, dv.data<float>() + offset, n,
                           with_bf16 ? db.data<bf16>() + offset : nullptr);
        }
        const std::vector<float> gp = test::to_host(dp), gm = test::to_host(dm),
                                 gv = test::to_host(dv);
        for (std::vector<float>* w : {&p, &m, &v}) w->erase(w->begin(), w->begin() + offset);
        auto tail = [&](std::vector<float> x) {
          x.erase(x.begin(), x.begin() + offset);
          return x;
        };
        // The same operations in the same order; FMA contraction may differ by a rounding.
        EXPECT_LE(test::rel_l2(tail(gp), p), 1e-6);
        EXPECT_LE(test::rel_l2(tail(gm), m), 1e-6);
        EXPECT_LE(test::rel_l2(tail(gv), v), 1e-6);
        if (with_bf16) {
          const std::vector<bf16> got = test::to_host_bf16(db);
          int64_t off_by_more = 0;
          for (int64_t i = 0; i < n; ++i) {
            const int d = int(got[size_t(i + offset)].bits) - int(pb[size_t(i + offset)].bits);
            if (d < -1 || d > 1) ++off_by_more;
          }
          EXPECT_EQ(off_by_more, 0) << "bf16 weights more than one ulp from the CPU's";
        }
      }
}

}  // namespace
}  // namespace loom::cuda
