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
#include "kernels/cpu/rope.hpp"
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
  const Tensor targets = Tensor::empty({64}, DType::i32, Device::meta);
  EXPECT_EQ(ops::linear_cross_entropy({x, w, dx, dw, targets, 48, 1.0f, 0, 0, {}}), 0.0);
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
    ops::LinearCrossEntropy ce{x,
                               w,
                               dx,
                               Tensor::zeros({V, K}, DType::f32),
                               ops::index_tensor(targets, Device::cpu, "target"),
                               V,
                               0.5f,
                               8,
                               16,
                               {}};
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

// Tokens, targets and positions reach the ops as int32/int64 tensors on the op's device, made once
// by index_tensor, which checks their range where they are still on the host; the ops refuse an
// index array of the wrong dtype, length or device; the rotary table needs its copy off the CPU.
TEST(Ops, IndexArraysAreTensorsOnTheOpsDevice) {
  const std::vector<int32_t> tokens{3, 0, 7, 5};
  const Tensor t = ops::index_tensor(tokens, Device::cpu, "token", 0, 8);
  ASSERT_EQ(t.dtype(), DType::i32);
  EXPECT_EQ(std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + 4), tokens);
  test::expect_error([&] { ops::index_tensor(tokens, Device::cpu, "input token", 0, 7); },
                     {"input token 7 at index 2 is outside [0, 7)"});
  test::expect_error(
      [&] { ops::index_tensor(std::vector<int32_t>{-1}, Device::cpu, "position", 0, 9); },
      {"position -1 at index 0 is outside [0, 9)"});
  const std::vector<int64_t> pos{9, 2, 1LL << 40};
  const Tensor p = ops::index_tensor(pos, Device::cpu, "position");
  ASSERT_EQ(p.dtype(), DType::i64);
  EXPECT_EQ(p.data<int64_t>()[2], int64_t{1} << 40);
  const Tensor m = ops::index_tensor(tokens, Device::meta, "token", 0, 8);
  EXPECT_EQ(m.device(), Device::meta);
  EXPECT_EQ(m.numel(), 4);

  // The embedding of these tokens is the kernel's; a wrong index array is refused by name.
  Tensor table = random({8, 6}, 11), out = Tensor::empty({4, 6}, DType::f32);
  ops::embedding_forward(t, table, out);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 6; ++j)
      EXPECT_EQ(out.data<float>()[i * 6 + j], table.data<float>()[tokens[size_t(i)] * 6 + j]);
  test::expect_error(
      [&] { ops::embedding_forward(t.narrow(0, 0, 3), table, out); },
      {"embedding_forward: tokens must be a contiguous int32 [4] on cpu, got [3] int32"});
  test::expect_error([&] { ops::embedding_forward(p, table, out); },
                     {"embedding_forward: tokens must be", "got [3] int64"});
  test::expect_error([&] { ops::embedding_forward(m, table, out); },
                     {"embedding_forward: tokens must be", "on cpu, got [4] int32 on meta"});

  // RoPE at the positions of a tensor equals the kernel at the same positions.
  const int64_t T = 5, H = 2, D = 8;
  const ops::Rope rope = ops::rope_table(D, 16, 10000.0, RopeScaling{});
  EXPECT_FALSE(rope.cos.defined());  // the CPU reads the host table
  const std::vector<int32_t> at{4, 0, 15, 3, 9};
  Tensor x = random({T, H * D}, 12);
  std::vector<float> want = values(x);
  cpu::rope_forward(want.data(), 1, T, H, D, H * D, at.data(), rope.host);
  ops::rope_forward(x, 1, H, ops::index_tensor(at, Device::cpu, "position", 0, 16), rope);
  EXPECT_EQ(values(x), want);
  test::expect_error([&] { ops::rope_forward(x, 1, H, t, rope); },
                     {"rope_forward: positions must be a contiguous int32 [5]"});
  // On meta the table is its size, and the device copy only where the meta run models a GPU
  // (which holds it: the planner's peak is the GPU's).
  const ops::Rope meta_rope = ops::rope_table(D, 16, 10000.0, RopeScaling{}, Device::meta);
  EXPECT_EQ(meta_rope.num_positions(), 16);
  EXPECT_FALSE(meta_rope.cos.defined());
  const ops::ModeledDevice gpu(Device::cuda);
  const ops::Rope gpu_rope = ops::rope_table(D, 16, 10000.0, RopeScaling{}, Device::meta);
  EXPECT_TRUE(gpu_rope.cos.defined() && gpu_rope.sin.defined());
  EXPECT_EQ(gpu_rope.cos.device(), Device::meta);
  EXPECT_EQ(gpu_rope.cos.shape(), (Shape{16, D / 2}));
}

// The gradient norm's sums: one call for many tensors gives each tensor's sum_squares bit for bit.
TEST(Ops, SumsOfSquaresOfManyTensorsEqualEachOnesSum) {
  const std::vector<Tensor> xs{random({7, 5}, 21), random({1}, 22), random({300}, 23)};
  const std::vector<double> s = ops::sum_squares_each(xs);
  ASSERT_EQ(s.size(), 3u);
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_EQ(s[i], ops::sum_squares(xs[i])) << i;
    double want = 0;
    for (float v : values(xs[i])) want += double(v) * double(v);
    EXPECT_NEAR(s[i], want, 1e-12 * want) << i;
  }
  EXPECT_TRUE(ops::sum_squares_each({}).empty());
  const Tensor m = Tensor::empty({4}, DType::f32, Device::meta);
  test::expect_error(
      [&] {
        ops::sum_squares_each(std::vector<Tensor>{xs[0], m});
      },
      {"sum_squares_each: tensors on cpu and meta"});
}
