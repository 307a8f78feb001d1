// The CUDA flash attention kernels (kernels/cuda/flash_attention.hpp) on the GPU against the CPU's
// bf16 attention kernels (kernels/cpu/attention_bf16.hpp) on the same inputs: random (never
// zeros), every output NaN first (an element the kernel misses fails), odd T, GQA, head dims 64
// and 128, q, k, v as strided views of one fused qkv buffer; the Llama 3.2 1B (Hq 32, Hkv 8, D 64)
// and Llama 3 8B (Hq 32, Hkv 8, D 128) shapes at T 2048; blocks with unsorted positions including
// rows that see no key, overwriting and accumulating; the backward run twice gives the same bits
// (no atomics). The same kernel code runs on the CPU in
// tests/kernels/flash_attention_emulation_test (no GPU needed); this test checks the real
// instructions. Bounds: attention_bf16_test.cpp's between the bf16 and the f32 kernels. Prints the
// differences and, for the Llama shapes, the kernels' time (causal FLOPs: forward 2 GEMMs, backward
// 5, over half the score matrix).
#include "kernels/cuda/flash_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/tensor.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_bf16.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/runtime.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/kernels/flash_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using cpu::AttentionShape;
using cpu::BlockShape;

namespace {

using namespace test::flash;  // the bounds, columns

using FlashCuda = test::CudaTest;

// Tq queries against Tk keys; positions empty: plain causal (Tq = Tk). q, k, v in one fused
// [B*T, (Hq+2Hkv)*D] buffer (block cases: Tq = Tk rows, the positions say who sees whom).
struct Case {
  int64_t B, T, Hq, Hkv, D;
  std::vector<int64_t> q_pos, k_pos;
  int64_t stride() const { return (Hq + 2 * Hkv) * D; }
  int64_t koff() const { return Hq * D; }
  int64_t voff() const { return (Hq + Hkv) * D; }
  float scale() const { return 1.0f / std::sqrt(float(D)); }
  BlockShape shape(bool accumulate) const {
    return {B, T, T, Hq, Hkv, D, stride(), stride(), scale(), accumulate};
  }
  std::string name() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " Hq=" + std::to_string(Hq) +
           " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D) +
           (q_pos.empty() ? " causal" : " block");
  }
};

void expect_rel(const std::vector<float>& a, const std::vector<float>& ref, double tol,
                const char* what) {
  const double e = test::rel_l2(a, ref);
  EXPECT_LT(e, tol) << what;
  std::printf("  %s %.2e", what, e);
}

Tensor to_device_i64(const std::vector<int64_t>& v) {
  if (v.empty()) return Tensor();
  std::vector<int32_t> halves(v.size() * 2);
  std::memcpy(halves.data(), v.data(), v.size() * sizeof(int64_t));
  return test::to_device_i32(halves);
}
const int64_t* i64(const Tensor& t) {
  return t.defined() ? static_cast<const int64_t*>(t.raw()) : nullptr;
}

double seconds_of(const std::function<void()>& f, int reps) {
  f();
  cuda::synchronize("flash timing");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  cuda::synchronize("flash timing");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

void check_case(const Case& c, uint64_t seed, bool time_it = false) {
  SCOPED_TRACE(c.name());
  std::printf("%s:", c.name().c_str());
  const bool block = !c.q_pos.empty();
  const int64_t rows = c.B * c.T, ow = c.Hq * c.D, kw = c.Hkv * c.D;
  const auto qkv = test::randn(size_t(rows * c.stride()), seed);
  const auto qkv16 = test::to_bf16(qkv);
  const auto dout = test::randn(size_t(rows * ow), seed + 1);
  const bf16 *hq = qkv16.data(), *hk = hq + c.koff(), *hv = hq + c.voff();
  const BlockShape s = c.shape(true);
  const AttentionShape as{c.B, c.T, c.Hq, c.Hkv, c.D, c.stride(), c.stride(), c.scale()};

  std::vector<float> out(size_t(rows * ow)), lse(size_t(c.B * c.Hq * c.T));
  if (block)
    cpu::attention_block_forward_bf16(s, hq, hk, hv, c.q_pos.data(), c.k_pos.data(), out.data(),
                                      lse.data());
  else
    cpu::attention_forward_bf16(as, hq, hk, hv, out.data(), lse.data());
  const std::vector<bf16> out16 = test::to_bf16(out);
  std::vector<float> delta(lse.size());
  cpu::attention_delta_bf16(c.B, c.T, c.Hq, c.D, out16.data(), dout.data(), delta.data());

  const Tensor x = test::to_device(qkv, DType::bf16);
  const bf16 *q = x.data<bf16>(), *k = q + c.koff(), *v = q + c.voff();
  const Tensor qp = to_device_i64(c.q_pos), kp = to_device_i64(c.k_pos);
  const Tensor o = test::nan_device(int64_t(out.size())), l = test::nan_device(int64_t(lse.size()));
  cuda::flash_attention_forward_bf16(s, q, k, v, i64(qp), i64(kp), o.data<float>(), nullptr,
                                     l.data<float>());
  expect_rel(test::to_host(o), out, kFwdTol, "out");
  const auto got_lse = test::to_host(l);
  double lerr = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse[i])) {
      EXPECT_EQ(got_lse[i], lse[i]) << "lse " << i;
      continue;
    }
    lerr = std::max(
        lerr, std::abs(double(got_lse[i]) - lse[i]) / std::max(1.0, std::abs(double(lse[i]))));
  }
  EXPECT_LT(lerr, kLseTol) << "lse";
  std::printf("  lse %.2e", lerr);

  const Tensor l_dev = test::to_device(lse), d_dev = test::to_device(delta),
               g_dev = test::to_device(dout);
  for (bool accumulate : {false, true}) {
    if (accumulate && !block) continue;
    std::vector<float> grad =
        accumulate ? test::randn(qkv.size(), seed + 2) : std::vector<float>(qkv.size(), 7.0f);
    std::vector<float> want = grad;
    if (block)
      cpu::attention_block_backward_bf16(
          c.shape(accumulate), hq, hk, hv, c.q_pos.data(), c.k_pos.data(), lse.data(), delta.data(),
          dout.data(), want.data(), want.data() + c.koff(), want.data() + c.voff());
    else
      cpu::attention_backward_bf16(as, hq, hk, hv, out16.data(), lse.data(), dout.data(),
                                   want.data(), want.data() + c.koff(), want.data() + c.voff());
    auto run = [&](const Tensor& dx) {
      float* gb = dx.data<float>();
      cuda::flash_attention_backward_bf16(c.shape(accumulate), q, k, v, i64(qp), i64(kp),
                                          l_dev.data<float>(), d_dev.data<float>(),
                                          g_dev.data<float>(), gb, gb + c.koff(), gb + c.voff());
    };
    const Tensor dx = accumulate ? test::to_device(grad) : test::nan_device(int64_t(grad.size()));
    run(dx);
    const auto got = test::to_host(dx);
    std::printf(accumulate ? "  | acc" : "  | bwd");
    expect_rel(columns(got, rows, c.stride(), 0, ow), columns(want, rows, c.stride(), 0, ow),
               kDqkTol, "dq");
    expect_rel(columns(got, rows, c.stride(), c.koff(), kw),
               columns(want, rows, c.stride(), c.koff(), kw), kDqkTol, "dk");
    expect_rel(columns(got, rows, c.stride(), c.voff(), kw),
               columns(want, rows, c.stride(), c.voff(), kw), kDvTol, "dv");
    if (!accumulate) {  // deterministic: a second run gives the same bits
      const Tensor dx2 = test::nan_device(int64_t(grad.size()));
      run(dx2);
      EXPECT_EQ(test::to_host(dx2), got) << "two backward runs differ";
    }
  }
  std::printf("\n");
  if (!time_it) return;
  const Tensor dx = test::nan_device(int64_t(qkv.size()));
  float* gb = dx.data<float>();
  const double tf = seconds_of(
      [&] {
        cuda::flash_attention_forward_bf16(s, q, k, v, nullptr, nullptr, o.data<float>(), nullptr,
                                           l.data<float>());
      },
      10);
  const double tb = seconds_of(
      [&] {
        cuda::flash_attention_backward_bf16(c.shape(false), q, k, v, nullptr, nullptr,
                                            l_dev.data<float>(), d_dev.data<float>(),
                                            g_dev.data<float>(), gb, gb + c.koff(), gb + c.voff());
      },
      10);
  const double pairs = double(c.B * c.Hq) * double(c.T) * double(c.T + 1) / 2;
  const double gemm = 2.0 * pairs * double(c.D);  // FLOPs of one GEMM over the causal half
  std::printf("  timing %s: forward %.3f ms (%.0f TFLOP/s), backward %.3f ms (%.0f TFLOP/s)\n",
              c.name().c_str(), tf * 1e3, 2 * gemm / tf * 1e-12, tb * 1e3, 5 * gemm / tb * 1e-12);
}

TEST_F(FlashCuda, CausalMatchesCpu) {
  check_case({2, 77, 4, 2, 64, {}, {}}, 1);
  check_case({1, 130, 4, 4, 128, {}, {}}, 2);
  check_case({1, 1, 2, 1, 64, {}, {}}, 3);
}

TEST_F(FlashCuda, LlamaShapesAtT2048) {
  check_case({1, 2048, 32, 8, 64, {}, {}}, 10, true);   // Llama 3.2 1B
  check_case({1, 2048, 32, 8, 128, {}, {}}, 11, true);  // Llama 3 8B
}

// Unsorted positions: a later chunk of queries against a shuffled key block, rows before every key
// (out 0, lse -inf), a key tile no query sees.
TEST_F(FlashCuda, BlockMatchesCpu) {
  std::mt19937_64 rng(5);
  for (int64_t D : {64, 128}) {
    Case c{2, 150, 4, 2, D, {}, {}};
    c.q_pos.resize(size_t(c.T));
    c.k_pos.resize(size_t(c.T));
    std::iota(c.k_pos.begin(), c.k_pos.end(), int64_t(20));
    std::shuffle(c.k_pos.begin(), c.k_pos.begin() + 128, rng);
    for (int64_t j = 128; j < c.T; ++j) c.k_pos[size_t(j)] = 1000 + j;
    std::uniform_int_distribution<int64_t> u(0, 200);
    for (int64_t& p : c.q_pos) p = u(rng);
    c.q_pos[3] = 5, c.q_pos[77] = 19;
    check_case(c, 30 + uint64_t(D));
  }
}

// attention.hpp's bf16 entry points take the flash kernels exactly when flash_attention_usable.
TEST(FlashAttention, Usable) {
  alignas(16) static bf16 buf[64];
  EXPECT_TRUE(cuda::flash_attention_usable(64, 512, 256, buf, buf + 8, buf + 16));
  EXPECT_TRUE(cuda::flash_attention_usable(128, 512, 256, buf, buf, buf));
  EXPECT_FALSE(cuda::flash_attention_usable(40, 512, 256, buf, buf, buf));
  EXPECT_FALSE(cuda::flash_attention_usable(64, 516, 256, buf, buf, buf));
  EXPECT_FALSE(cuda::flash_attention_usable(64, 512, 256, buf + 1, buf, buf));
}

}  // namespace
