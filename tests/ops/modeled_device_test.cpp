// A meta run that models a GPU (ops::ModeledDevice) books the CUDA kernels' scratch: cuBLASLt's
// workspace once, the fused loss's block, the exact attention's score matrices; one that models
// the CPU books the CPU kernels' (the loss's chunk and packed weight, no attention scratch).
#include <gtest/gtest.h>

#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "kernels/cuda/scratch.hpp"
#include "ops/ops.hpp"
#include "tests/test_util.hpp"

namespace loom {
namespace {

Tensor meta(const Shape& s, DType dt = DType::f32) {
  return Tensor::empty(s, dt, Device::meta);
}

// The rise of the meta allocator's peak over what is allocated while `fn` runs.
template <class Fn>
size_t scratch_peak(Fn&& fn) {
  Allocator& a = Allocator::get(Device::meta);
  // From an empty cache: a cached block up to 25% larger than asked for would be booked whole.
  a.empty_cache();
  const size_t before = a.stats().allocated;
  a.reset_peak();
  fn();
  return a.stats().peak_allocated - before;
}

size_t rounded(const std::vector<cuda::ScratchBlock>& blocks) {
  size_t n = 0;
  for (const cuda::ScratchBlock& b : blocks)
    n += Allocator::round_size(size_t(b.numel) * dtype_size(b.dtype));
  return n;
}

TEST(ModeledDevice, AGpuPlanBooksTheWorkspaceOnceAtTheFirstGemm) {
  Allocator& a = Allocator::get(Device::meta);
  Tensor x = meta({8, 16}), w = meta({4, 16}), y = meta({8, 4});
  const size_t base = a.stats().allocated;
  {
    const ops::ModeledDevice gpu(Device::cuda);
    EXPECT_EQ(ops::modeled_device(), Device::cuda);
    ops::fill(y, 0.0f);  // not a GEMM: nothing
    EXPECT_EQ(a.stats().allocated, base);
    ops::linear(x, w, y);
    EXPECT_EQ(a.stats().allocated - base, Allocator::round_size(cuda::kGemmWorkspaceBytes));
    ops::linear(x, w, y);  // kept, not booked again
    EXPECT_EQ(a.stats().allocated - base, Allocator::round_size(cuda::kGemmWorkspaceBytes));
    test::expect_error([] { ops::ModeledDevice again(Device::cuda); },
                       {"ModeledDevice: one is already alive on this thread"});
  }
  EXPECT_EQ(a.stats().allocated, base);  // released with the scope
  EXPECT_EQ(ops::modeled_device(), Device::cpu);
  ops::linear(x, w, y);  // the CPU's GEMMs take no workspace
  EXPECT_EQ(a.stats().allocated, base);
  test::expect_error([] { ops::ModeledDevice m(Device::meta); }, {"models cpu or cuda, not meta"});
}

TEST(ModeledDevice, AttentionScratchIsTheGpuKernelsOnAGpuPlanOnly) {
  const int64_t B = 2, T = 100, Hq = 4, Hkv = 2, D = 16;
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor q = meta({B * T, Hq * D}, dt), k = meta({B * T, Hkv * D}, dt),
           v = meta({B * T, Hkv * D}, dt), out = meta({B * T, Hq * D}, dt), lse = meta({B, Hq, T});
    Tensor dout = meta({B * T, Hq * D}), dq = meta({B * T, Hq * D}), dk = meta({B * T, Hkv * D}),
           dv = meta({B * T, Hkv * D});
    const auto forward = [&] { ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse); };
    const auto backward = [&] {
      ops::attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv);
    };
    EXPECT_EQ(scratch_peak(forward), 0u);
    EXPECT_EQ(scratch_peak(backward), 0u);
    const ops::ModeledDevice gpu(Device::cuda);
    const bool bf16 = dt == DType::bf16;
    // S [T, 104] f32 at least, per call (reused by every sample and head).
    const size_t fwd =
        rounded(cuda::attention_scratch(B, T, T, Hq, D, bf16, false, bf16, true, false));
    const size_t bwd =
        rounded(cuda::attention_scratch(B, T, T, Hq, D, bf16, true, false, true, false));
    EXPECT_GE(fwd, size_t(T * 104 * 4));
    EXPECT_GE(bwd, size_t(2 * T * 104 * 4));
    EXPECT_EQ(scratch_peak(forward), fwd) << dtype_name(dt);
    EXPECT_EQ(scratch_peak(backward), bwd) << dtype_name(dt);
  }
}

// bf16 at head dim 64 takes the flash kernels: no score matrix, the backward's delta and rounded
// dout only (and a ring block's tile ranges).
TEST(ModeledDevice, FlashAttentionBooksLinearScratch) {
  const int64_t B = 2, T = 300, Hq = 4, Hkv = 2, D = 64;
  Tensor q = meta({B * T, Hq * D}, DType::bf16), k = meta({B * T, Hkv * D}, DType::bf16),
         v = meta({B * T, Hkv * D}, DType::bf16), out = meta({B * T, Hq * D}, DType::bf16),
         lse = meta({B, Hq, T});
  Tensor dout = meta({B * T, Hq * D}), dq = meta({B * T, Hq * D}), dk = meta({B * T, Hkv * D}),
         dv = meta({B * T, Hkv * D});
  ASSERT_TRUE(cuda::flash_attention_takes(true, D, Hq * D, Hkv * D));
  EXPECT_FALSE(cuda::flash_attention_takes(false, D, Hq * D, Hkv * D));
  EXPECT_FALSE(cuda::flash_attention_takes(true, 96, 96 * 4, 96 * 2));
  const ops::ModeledDevice gpu(Device::cuda);
  EXPECT_EQ(scratch_peak([&] { ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse); }), 0u);
  const size_t bwd = scratch_peak(
      [&] { ops::attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv); });
  EXPECT_EQ(bwd, Allocator::round_size(size_t(B * Hq * T) * 4) +
                     Allocator::round_size(size_t(B * T * Hq * D) * 2));
  // A ring block: 5 + 5 tiles of 64 give ten [lo, hi] pairs of int64.
  std::vector<int64_t> qp(T), kp(T);
  for (int64_t i = 0; i < T; ++i) qp[size_t(i)] = T + i, kp[size_t(i)] = i;
  const Tensor qd = ops::index_tensor(qp, Device::meta, "position"),
               kd = ops::index_tensor(kp, Device::meta, "position");
  const ops::AttentionBlock blk{B, Hq, Hkv, &qp, &kp, &qd, &kd};
  Tensor fl = meta({B * T, Hq * D});
  EXPECT_EQ(scratch_peak([&] { ops::attention_block_forward(blk, q, k, v, fl, lse); }),
            Allocator::round_size(10 * 2 * 8));
}

TEST(ModeledDevice, TheLossBooksTheGpuKernelsBlockInsteadOfTheCpus) {
  const int64_t N = 300, Dm = 32, V = 1000;
  for (DType dt : {DType::f32, DType::bf16}) {
    ops::LinearCrossEntropy a;
    a.x = meta({N, Dm}, dt);
    a.w = meta({V, Dm}, dt);
    a.dx = meta({N, Dm});
    a.dw = meta({V, Dm});
    a.targets = meta({N}, DType::i32);
    a.V = V;
    a.chunk_rows = 64;
    a.grad_rows = 128;
    a.loss = meta({1}, DType::f64);
    const size_t cpu = scratch_peak([&] { ops::linear_cross_entropy(a); });
    EXPECT_GE(cpu, size_t(64 * V * 4)) << dtype_name(dt);  // one chunk of f32 logits at least
    const ops::ModeledDevice gpu(Device::cuda);
    const std::vector<cuda::ScratchBlock> want =
        cuda::loss_scratch(N, V, dt, true, a.chunk_rows, a.grad_rows);
    ASSERT_EQ(want.size(), 1u);
    // The block holds the chunk of logits, the bf16 gradients (bf16), the N per-row losses.
    const size_t raw = size_t(want[0].numel) * 4;
    EXPECT_GE(raw, size_t(64 * V * 4 + N * 8 + (dt == DType::bf16 ? 128 * V * 2 : 0)));
    EXPECT_LT(raw, size_t(64 * V * 4 + N * 8 + (dt == DType::bf16 ? 128 * V * 2 : 0) + 1024));
    // (The first GEMM of the call also books the workspace, kept after it.)
    const size_t got = scratch_peak([&] { ops::linear_cross_entropy(a); });
    EXPECT_EQ(got, rounded(want) + Allocator::round_size(cuda::kGemmWorkspaceBytes))
        << dtype_name(dt);
  }
}

}  // namespace
}  // namespace loom
