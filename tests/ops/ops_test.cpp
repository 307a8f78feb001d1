// ops/: on cpu an op gives the bits of the kernel it dispatches to; on meta it computes nothing
// (outputs untouched, no error); on a device without kernels it is a clear error.
#include "ops/ops.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "core/allocator.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/sharded.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

Tensor random(const Shape& s, uint64_t seed) {
  Tensor t = Tensor::empty(s, DType::f32);
  const auto v = test::randn(size_t(t.numel()), seed);
  std::memcpy(t.raw(), v.data(), t.nbytes());
  return t;
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

}  // namespace

TEST(Ops, CpuOpsEqualTheKernels) {
  const int64_t M = 33, K = 24, N = 40;
  Tensor x = random({M, K}, 1), w = random({N, K}, 2), y = random({M, N}, 3);
  std::vector<float> want = values(y);
  cpu::linear_forward(x.raw(), w.raw(), want.data(), M, N, K, DType::f32, true);
  ops::linear(x, w, y, true);
  EXPECT_EQ(values(y), want);

  // bf16: the rounded copy, then the bf16 GEMM.
  Tensor xb = ops::to_compute(x, DType::bf16), wb = ops::to_compute(w, DType::bf16);
  EXPECT_EQ(xb.dtype(), DType::bf16);
  std::vector<float> want_b(size_t(M * N));
  cpu::linear_forward(xb.raw(), wb.raw(), want_b.data(), M, N, K, DType::bf16);
  ops::linear(xb, wb, y);
  EXPECT_EQ(values(y), want_b);

  Tensor nw = random({K}, 4), xn = Tensor::empty({M, K}, DType::f32),
         rstd = Tensor::empty({M}, DType::f32);
  std::vector<float> wxn(size_t(M * K)), wr(static_cast<size_t>(M));
  cpu::rmsnorm_forward(x.data<float>(), nw.data<float>(), M, K, 1e-5f, wxn.data(), wr.data());
  ops::rmsnorm_forward(x, nw, 1e-5f, xn, rstd);
  EXPECT_EQ(values(xn), wxn);
  EXPECT_EQ(values(rstd), wr);

  Tensor gu = random({M, 2 * K}, 5), act = Tensor::empty({M, K}, DType::f32);
  std::vector<float> wact(size_t(M * K));
  cpu::swiglu_forward(gu.data<float>(), M, K, wact.data());
  ops::swiglu_forward(gu, act);
  EXPECT_EQ(values(act), wact);

  // Attention on views of a fused qkv buffer: the strides come from the views.
  const int64_t B = 2, T = 20, Hq = 4, Hkv = 2, D = 8, S = (Hq + 2 * Hkv) * D;
  Tensor qkv = random({B * T, S}, 6);
  Tensor out = Tensor::empty({B * T, Hq * D}, DType::f32),
         lse = Tensor::empty({B, Hq, T}, DType::f32);
  std::vector<float> wout(size_t(B * T * Hq * D)), wlse(size_t(B * Hq * T));
  const float* q = qkv.data<float>();
  cpu::attention_forward({B, T, Hq, Hkv, D, S, S, 1.0f / std::sqrt(float(D))}, q, q + Hq * D,
                         q + (Hq + Hkv) * D, wout.data(), wlse.data());
  ops::attention_forward(qkv.narrow(1, 0, Hq * D), qkv.narrow(1, Hq * D, Hkv * D),
                         qkv.narrow(1, (Hq + Hkv) * D, Hkv * D), B, Hq, Hkv, out, lse);
  EXPECT_EQ(values(out), wout);
  EXPECT_EQ(values(lse), wlse);

  Tensor kv = Tensor::empty({B * T, 2 * Hkv * D}, DType::f32);
  ops::copy_rows(qkv.narrow(1, Hq * D, 2 * Hkv * D), kv);
  std::vector<float> wkv(size_t(B * T * 2 * Hkv * D));
  cpu::copy_rows(q + Hq * D, S, wkv.data(), 2 * Hkv * D, B * T, 2 * Hkv * D);
  EXPECT_EQ(values(kv), wkv);
}

TEST(Ops, MetaComputesNothingAndBooksMemory) {
  auto& meta = Allocator::get(Device::meta);
  const size_t before = meta.stats().allocated;
  Tensor x = Tensor::empty({64, 32}, DType::f32, Device::meta);
  Tensor w = Tensor::empty({48, 32}, DType::f32, Device::meta);
  Tensor y = Tensor::empty({64, 48}, DType::f32, Device::meta);
  EXPECT_GE(meta.stats().allocated - before, size_t(64 * 32 + 48 * 32 + 64 * 48) * 4);
  // The meta pointers are never dereferenced: any kernel call would crash.
  ops::linear(x, w, y, true);
  Tensor dx = Tensor::empty({64, 32}, DType::f32, Device::meta);
  Tensor dw = Tensor::empty({48, 32}, DType::f32, Device::meta);
  ops::linear_backward(y, x, w, dw, dx);
  Tensor xb = ops::to_compute(x, DType::bf16);
  EXPECT_EQ(xb.device(), Device::meta);
  // to_compute books its bf16 copy like the cpu does.
  EXPECT_GE(meta.stats().allocated - before,
            size_t(2 * 64 * 32 + 2 * 48 * 32 + 64 * 48) * 4 + size_t(64 * 32) * 2);
  ops::fill(y, 1.0f);
  ops::add_inplace(y, y);
  EXPECT_EQ(ops::linear_cross_entropy({x, w, dx, dw, nullptr, 48, 1.0f, 0}), 0.0);
  EXPECT_FALSE(ops::computes(Device::meta));
  EXPECT_TRUE(ops::computes(Device::cpu));
}

// A weight gradient marked unwritten is written, never read (it may hold anything, NaN here),
// once; the flags of a fused matrix clear together and later GEMMs add. Deferred, the first GEMM
// to run writes. The fused loss writes its dW on its first group of rows the same way.
TEST(Ops, UnwrittenWeightGradientIsWrittenOnceThenAddedTo) {
  const int64_t M = 33, K = 24, N = 40;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor x = ops::to_compute(random({M, K}, 1), dt),
                 w = ops::to_compute(random({N, K}, 2), dt),
                 dy = ops::to_compute(random({M, N}, 3), dt);
    Tensor dx = Tensor::empty({M, K}, DType::f32);
    Tensor want = Tensor::zeros({N, K}, DType::f32);
    ops::linear_backward(dy, x, w, want, dx);
    const std::vector<float> once = values(want);
    Tensor dw = Tensor::empty({N, K}, DType::f32);
    ops::fill(dw, nan);
    uint8_t flags[2] = {1, 1};
    ops::linear_backward(dy, x, w, ops::WeightGrad(dw, flags), dx);
    EXPECT_EQ(values(dw), values(want)) << dtype_name(dt);
    EXPECT_EQ(flags[0] + flags[1], 0);
    ops::linear_backward(dy, x, w, ops::WeightGrad(dw, flags), dx);
    ops::linear_backward(dy, x, w, want, dx);
    EXPECT_EQ(values(dw), values(want)) << dtype_name(dt);

    // Deferred: the flags are read when the GEMM runs, not when it is deferred.
    ops::fill(dw, nan);
    flags[0] = flags[1] = 1;
    std::vector<ops::DeferredWeightGrad> later;
    {
      ops::DeferWeightGrads defer(later);
      ops::linear_backward(dy, x, w, ops::WeightGrad(dw, flags), dx);
      ops::linear_backward(dy, x, w, ops::WeightGrad(dw, flags), dx);
    }
    EXPECT_EQ(flags[0], 1);
    ops::run_weight_grads(later);
    EXPECT_EQ(values(dw), values(want)) << dtype_name(dt);
    // WeightGradsNow inside the deferral: that GEMM runs at once, the deferral resumes after it.
    ops::fill(dw, nan);
    flags[0] = flags[1] = 1;
    {
      ops::DeferWeightGrads defer(later);
      {
        const ops::WeightGradsNow now;
        ops::linear_backward(dy, x, w, ops::WeightGrad(dw, flags), dx);
      }
      EXPECT_TRUE(later.empty());
      EXPECT_EQ(values(dw), once) << dtype_name(dt);
      ops::linear_backward(dy, x, w, ops::WeightGrad(dw, flags), dx);
      EXPECT_EQ(later.size(), 1u);
    }
    ops::run_weight_grads(later);
    EXPECT_EQ(values(dw), values(want)) << dtype_name(dt);  // twice

    // The fused loss over several groups of rows (chunk 8, gradient rows 16).
    const int64_t V = 40;
    std::vector<int32_t> targets(static_cast<size_t>(M));
    for (int64_t i = 0; i < M; ++i) targets[size_t(i)] = int32_t((i * 7) % V);
    ops::LinearCrossEntropy ce{x,    w, dx, Tensor::zeros({V, K}, DType::f32), targets.data(), V,
                               0.5f, 8, 16};
    const double loss = ops::linear_cross_entropy(ce);
    const std::vector<float> want_ce = values(ce.dw.t);
    ops::fill(ce.dw.t, nan);
    ce.dw.unwritten = std::span<uint8_t>(flags, 1);
    flags[0] = 1;
    EXPECT_EQ(ops::linear_cross_entropy(ce), loss);
    EXPECT_EQ(values(ce.dw.t), want_ce) << dtype_name(dt);
    EXPECT_EQ(flags[0], 0);
  }
}

TEST(Ops, ADeviceWithoutKernelsIsAnErrorNamingTheOp) {
  Tensor x = Tensor::empty({4, 4}, DType::f32, Device::elsewhere);
  Tensor y = Tensor::empty({4, 4}, DType::f32, Device::elsewhere);
  try {
    ops::linear(x, x, y);
    FAIL() << "a GEMM ran on another rank's tensors";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear: no kernel for device elsewhere"),
              std::string::npos)
        << e.what();
  }
}
