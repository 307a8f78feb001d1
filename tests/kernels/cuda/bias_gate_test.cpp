// The CUDA bias and gate kernels of Qwen2-MoE against the CPU kernels (kernels/cpu/bias_gate.hpp,
// themselves checked against fp64 references and finite differences in
// tests/kernels/bias_gate_test.cpp), on random inputs (never zeros), outputs filled with NaN
// first: add_bias and bias_grad on strided views (a column slice of a fused GEMM's output), rows
// from 0 to several of bias_grad's row ranges; the sigmoid gate with logits far into both tails,
// ys f32 and bf16, dys f32 and bf16, and zero rows.
#include "kernels/cuda/bias_gate.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/bias_gate.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

class BiasGateCuda : public test::CudaTest {};

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

Tensor dev_f32(std::vector<float> v) {
  if (v.empty()) v.push_back(kNan);  // a zero-row case holds nothing
  return test::to_device(v);
}
std::vector<float> host_f32(const Tensor& d, size_t n) {
  std::vector<float> v = test::to_host(d);
  v.resize(n);
  return v;
}
double ulp(float v) {
  const float a = std::abs(v);
  return double(std::nextafter(a, std::numeric_limits<float>::infinity()) - a);
}
// |got - want| <= bound[i] everywhere (never NaN); with `equal_share` > 0, at least that share of
// the elements with the CPU's bits.
void expect_within(const std::vector<float>& got, const std::vector<float>& want,
                   const std::vector<double>& bound, const std::string& what,
                   double equal_share = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, equal = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    equal += std::memcmp(&got[i], &want[i], sizeof(float)) == 0;
    if (!(std::abs(double(got[i]) - double(want[i])) <= bound[i]) && ++bad <= 5)
      ADD_FAILURE() << what << " [" << i << "]: " << got[i] << " vs the CPU's " << want[i]
                    << " (bound " << bound[i] << ")";
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_GE(double(equal), equal_share * double(got.size())) << what << ": the CPU's bits";
}

struct View {
  int64_t M, N, ld;
};
// Zero rows, one, odd widths and strides, more rows than one range of bias_grad (32) and than
// 512 ranges of 32 (the ranges grow), Qwen2-57B-A14B's fused q/k/v bias (3584 + 2 x 512).
const std::vector<View> kViews = {{0, 5, 5},     {1, 1, 1},      {3, 7, 12},      {37, 33, 40},
                                  {300, 64, 64}, {3000, 65, 96}, {20000, 33, 33}, {64, 4608, 4608}};

std::string name(const View& v) {
  return "M " + std::to_string(v.M) + ", N " + std::to_string(v.N) + ", ld " + std::to_string(v.ld);
}

TEST_F(BiasGateCuda, AddBiasMatchesCpuBitForBit) {
  for (const View& v : kViews) {
    SCOPED_TRACE(name(v));
    const std::vector<float> y0 = test::randn(size_t(v.M * v.ld), 1),
                             b = test::randn(size_t(v.N), 2);
    std::vector<float> y = y0;
    cpu::add_bias(y.data(), v.M, v.N, v.ld, b.data());
    Tensor gy = dev_f32(y0), gb = dev_f32(b);
    cuda::add_bias(gy.data<float>(), v.M, v.N, v.ld, gb.data<float>());
    const std::vector<float> got = host_f32(gy, y.size());
    EXPECT_TRUE(test::same_bits(got, y)) << "y (and the columns past N left as they were)";
  }
}

TEST_F(BiasGateCuda, BiasGradMatchesCpu) {
  for (const View& v : kViews) {
    SCOPED_TRACE(name(v));
    const std::vector<float> dy = test::randn(size_t(v.M * v.ld), 3);
    const std::vector<float> db0 = test::randn(size_t(v.N), 4);
    std::vector<float> db = db0;
    cpu::bias_grad(dy.data(), v.M, v.N, v.ld, db.data());
    Tensor gdy = dev_f32(dy), gdb = dev_f32(db0);
    cuda::bias_grad(gdy.data<float>(), v.M, v.N, v.ld, gdb.data<float>());
    // The column sums in double in another order: within a rounding of the CPU's f32 result
    // (sum |dy| bounds the double sums' difference).
    std::vector<double> bound(db.size());
    for (int64_t c = 0; c < v.N; ++c) {
      double mag = std::abs(double(db0[size_t(c)]));
      for (int64_t m = 0; m < v.M; ++m) mag += std::abs(double(dy[size_t(m * v.ld + c)]));
      bound[size_t(c)] = ulp(db[size_t(c)]) + 1e-12 * mag;
    }
    const std::vector<float> got = host_f32(gdb, db.size());
    expect_within(got, db, bound, "db", 0.9);
    if (v.M == 0) {
      EXPECT_TRUE(test::same_bits(got, db0)) << "db touched by zero rows";
    }
  }
}

struct Rows {
  int64_t M, d;
};
const std::vector<Rows> kRows = {{0, 8}, {1, 1}, {3, 7}, {37, 64}, {300, 33}, {64, 2048}};

// Gate logits of a few units' scale, some far into both tails (the sigmoid 0 or 1 in f32, its
// slope e^-|z| still exact in double).
std::vector<float> gate_logits(int64_t M, uint64_t seed) {
  std::vector<float> z = test::randn(size_t(M), seed, 3.0f);
  const float tails[] = {40.0f, -40.0f, 100.0f, -100.0f, 17.5f, -17.5f};
  for (size_t i = 0; i < z.size() && i < 6; ++i) z[i * 5 % z.size()] = tails[i];
  return z;
}

TEST_F(BiasGateCuda, SigmoidGateForwardMatchesCpu) {
  for (const Rows& r : kRows)
    for (const bool half : {false, true}) {
      SCOPED_TRACE("M " + std::to_string(r.M) + ", d " + std::to_string(r.d) +
                   (half ? ", ys bf16" : ", ys f32"));
      const std::vector<float> z = gate_logits(r.M, 5), ys = test::randn(size_t(r.M * r.d), 6);
      const std::vector<float> y0 = test::randn(size_t(r.M * r.d), 7);
      const std::vector<bf16> ys16 = test::round_bf16(ys);
      std::vector<float> y = y0;
      if (half)
        cpu::sigmoid_gate_forward(z.data(), ys16.data(), r.M, r.d, y.data());
      else
        cpu::sigmoid_gate_forward(z.data(), ys.data(), r.M, r.d, y.data());
      Tensor gz = dev_f32(z), gy = dev_f32(y0);
      Tensor gys =
          test::to_device(ys.empty() ? std::vector<float>{1} : ys, half ? DType::bf16 : DType::f32);
      if (half)
        cuda::sigmoid_gate_forward(gz.data<float>(), gys.data<bf16>(), r.M, r.d, gy.data<float>());
      else
        cuda::sigmoid_gate_forward(gz.data<float>(), gys.data<float>(), r.M, r.d, gy.data<float>());
      // The sigmoid's exp may differ from glibc's in the last bit (rarely): then s by an ulp, and
      // y by an ulp of the product.
      std::vector<double> bound(y.size());
      for (size_t i = 0; i < y.size(); ++i) bound[i] = ulp(y[i]) + 2.5e-7 * std::abs(double(ys[i]));
      expect_within(host_f32(gy, y.size()), y, bound, "y", 0.6);
    }
}

// The backward for one pair of dtypes against the CPU's on the same inputs.
template <class Y, class D>
void check_gate_backward(const Rows& r, uint64_t seed) {
  const std::vector<float> z = gate_logits(r.M, seed),
                           dy = test::randn(size_t(r.M * r.d), seed + 1);
  const std::vector<float> ys32 = test::randn(size_t(r.M * r.d), seed + 2);
  std::vector<Y> ys(ys32.size());
  std::vector<float> ys_w(ys32.size());
  for (size_t i = 0; i < ys.size(); ++i) {
    if constexpr (sizeof(Y) == 2)
      ys[i] = float_to_bf16(ys32[i]), ys_w[i] = bf16_to_float(ys[i]);
    else
      ys[i] = ys32[i], ys_w[i] = ys32[i];
  }
  std::vector<D> dys(ys.size());
  std::vector<float> dz(size_t(r.M));
  cpu::sigmoid_gate_backward(dy.data(), z.data(), ys.data(), r.M, r.d, dys.data(), dz.data());
  constexpr DType ydt = sizeof(Y) == 2 ? DType::bf16 : DType::f32;
  constexpr DType ddt = sizeof(D) == 2 ? DType::bf16 : DType::f32;
  Tensor gz = dev_f32(z), gdy = dev_f32(dy);
  Tensor gys = test::to_device(ys_w.empty() ? std::vector<float>{1} : ys_w, ydt);
  Tensor gdys = test::nan_device(std::max<int64_t>(r.M * r.d, 1), ddt);
  Tensor gdz = dev_f32(std::vector<float>(dz.size(), kNan));
  cuda::sigmoid_gate_backward(gdy.data<float>(), gz.data<float>(), gys.data<Y>(), r.M, r.d,
                              gdys.data<D>(), gdz.data<float>());
  // dys = s dy: the CPU's bits but where the exp differs (rarely; then an ulp of s, and of dys; a
  // bf16 dys rounded from values an ulp apart: at most one bf16 ulp, 2^16 f32 ulps).
  std::vector<float> got = test::to_host(gdys), want(dys.size());
  got.resize(dys.size());
  std::vector<double> bound(dys.size());
  for (size_t i = 0; i < dys.size(); ++i) {
    float w;
    if constexpr (sizeof(D) == 2)
      w = bf16_to_float(dys[i]);
    else
      w = dys[i];
    want[i] = w;
    bound[i] = sizeof(D) == 2 ? 65536 * ulp(w) : ulp(w) + 2.5e-7 * std::abs(double(dy[i]));
  }
  expect_within(got, want, bound, "dys", 0.6);
  // dz: the dot in double in another order, times the slope in double: within an ulp or two of the
  // CPU's, plus the dot's rounding (sum |dy ys| s (1 - s)).
  std::vector<double> zb(dz.size());
  for (int64_t t = 0; t < r.M; ++t) {
    double mag = 0;
    for (int64_t c = 0; c < r.d; ++c)
      mag += std::abs(double(dy[size_t(t * r.d + c)]) * double(ys_w[size_t(t * r.d + c)]));
    const double e = std::exp(-std::abs(double(z[size_t(t)])));
    zb[size_t(t)] = 2 * ulp(dz[size_t(t)]) + 1e-12 * mag * e / ((1 + e) * (1 + e));
  }
  expect_within(host_f32(gdz, dz.size()), dz, zb, "dz");
}

TEST_F(BiasGateCuda, SigmoidGateBackwardMatchesCpu) {
  for (const Rows& r : kRows) {
    SCOPED_TRACE("M " + std::to_string(r.M) + ", d " + std::to_string(r.d));
    {
      SCOPED_TRACE("ys f32, dys f32");
      check_gate_backward<float, float>(r, 11);
    }
    {
      SCOPED_TRACE("ys bf16, dys f32");
      check_gate_backward<bf16, float>(r, 12);
    }
    {
      SCOPED_TRACE("ys f32, dys bf16");
      check_gate_backward<float, bf16>(r, 13);
    }
    {
      SCOPED_TRACE("ys bf16, dys bf16");
      check_gate_backward<bf16, bf16>(r, 14);
    }
  }
}

}  // namespace
