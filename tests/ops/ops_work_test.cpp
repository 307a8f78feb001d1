// ops::RecordWork: the work an op reports on the meta device (the planner's time model) — exact
// GEMM flops and shapes, attention counted by the tiles its kernel computes — and nothing on cpu
// or without a recorder.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "ops/ops.hpp"

using namespace loom;

namespace {

Tensor meta(const Shape& s, DType dt = DType::f32) {
  return Tensor::empty(s, dt, Device::meta);
}

struct Recorded {
  std::vector<ops::KernelWork> works;
  ops::RecordWork record{[this](const ops::KernelWork& w) { works.push_back(w); }};
};

// (query, key) entries of the tile pairs the kernel computes, entry by entry: a pair of 64-wide
// tiles is skipped only when every key position follows every query position.
int64_t brute_force_entries(const std::vector<int64_t>& qp, const std::vector<int64_t>& kp) {
  const int64_t tile = 64, Tq = int64_t(qp.size()), Tk = int64_t(kp.size());
  int64_t n = 0;
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t j = 0; j < Tk; ++j) {
      const int64_t qi = i / tile, kj = j / tile;
      const auto q0 = qp.begin() + qi * tile, q1 = qp.begin() + std::min(Tq, (qi + 1) * tile);
      const auto k0 = kp.begin() + kj * tile, k1 = kp.begin() + std::min(Tk, (kj + 1) * tile);
      n += *std::min_element(k0, k1) <= *std::max_element(q0, q1);
    }
  return n;
}

std::vector<int64_t> iota(int64_t n, int64_t from = 0) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

}  // namespace

TEST(OpsWork, LinearIsOneGemm) {
  const int64_t M = 96, N = 40, K = 24;
  Tensor x = meta({M, K}, DType::bf16), w = meta({N, K}, DType::bf16), y = meta({M, N});
  Recorded r;
  ops::linear(x, w, y);
  ASSERT_EQ(r.works.size(), 1u);
  const ops::KernelWork& g = r.works[0];
  EXPECT_EQ(std::string(g.op), "linear");
  EXPECT_EQ(g.dtype, DType::bf16);
  EXPECT_EQ(g.flops, 2.0 * M * N * K);
  EXPECT_EQ(g.m, M);
  EXPECT_EQ(g.n, N);
  EXPECT_EQ(g.k, K);
  // bf16 inputs, an f32 output.
  EXPECT_EQ(g.bytes, double(M * K + N * K) * 2 + double(M * N) * 4);
}

TEST(OpsWork, LinearBackwardIsTwoGemmsAndDefersTheWeightGemm) {
  const int64_t M = 64, N = 48, K = 32;
  Tensor dy = meta({M, N}), x = meta({M, K}), w = meta({N, K}), dw = meta({N, K}),
         dx = meta({M, K});
  {
    Recorded r;
    ops::linear_backward(dy, x, w, dw, dx);
    ASSERT_EQ(r.works.size(), 2u);
    EXPECT_EQ(std::string(r.works[0].op), "linear_backward");  // dx [M, K] = dy [M, N] w
    EXPECT_EQ(r.works[0].m, M);
    EXPECT_EQ(r.works[0].n, K);
    EXPECT_EQ(r.works[0].k, N);
    EXPECT_EQ(std::string(r.works[1].op), "linear_backward_weight");  // dw [N, K] += dy^T x
    EXPECT_EQ(r.works[1].m, N);
    EXPECT_EQ(r.works[1].n, K);
    EXPECT_EQ(r.works[1].k, M);
    for (const ops::KernelWork& g : r.works) EXPECT_EQ(g.flops, 2.0 * M * N * K);
  }
  std::vector<ops::DeferredWeightGrad> deferred;
  Recorded r;
  {
    ops::DeferWeightGrads defer(deferred);
    ops::linear_backward(dy, x, w, dw, dx);
  }
  ASSERT_EQ(r.works.size(), 1u);
  EXPECT_EQ(std::string(r.works[0].op), "linear_backward");
  ASSERT_EQ(deferred.size(), 1u);
  ops::run_weight_grads(deferred);
  ASSERT_EQ(r.works.size(), 2u);
  EXPECT_EQ(std::string(r.works[1].op), "linear_backward_weight");
  EXPECT_EQ(r.works[1].flops, 2.0 * M * N * K);
  EXPECT_EQ(r.works[1].m, N);
}

TEST(OpsWork, AttentionCountsTheTilesTheKernelComputes) {
  const int64_t B = 2, Hq = 4, Hkv = 2, D = 16;
  for (int64_t T : {1, 63, 64, 65, 200, 512}) {
    Tensor q = meta({B * T, Hq * D}), k = meta({B * T, Hkv * D}), v = meta({B * T, Hkv * D});
    Tensor out = meta({B * T, Hq * D}), lse = meta({B, Hq, T});
    Tensor dq = meta({B * T, Hq * D}), dk = meta({B * T, Hkv * D}), dv = meta({B * T, Hkv * D});
    Recorded r;
    ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse);
    ops::attention_backward(q, k, v, out, lse, out, B, Hq, Hkv, dq, dk, dv);
    ASSERT_EQ(r.works.size(), 2u);
    const double entries = double(brute_force_entries(iota(T), iota(T)));
    EXPECT_GE(entries, T * (T + 1) / 2.0);  // at least the causal pairs
    EXPECT_EQ(r.works[0].flops, 4.0 * B * Hq * D * entries) << "T " << T;
    EXPECT_EQ(r.works[1].flops, 2.5 * r.works[0].flops) << "T " << T;
    EXPECT_GT(r.works[0].bytes, 0);
  }
}

TEST(OpsWork, AttentionBlockCountsItsPositions) {
  // Zigzag chunks of a ring: queries [0, 50) + [350, 400) against keys [100, 150) + [250, 300).
  std::vector<int64_t> qp = iota(50), kp = iota(50, 100), q2 = iota(50, 350), k2 = iota(50, 250);
  qp.insert(qp.end(), q2.begin(), q2.end());
  kp.insert(kp.end(), k2.begin(), k2.end());
  const int64_t B = 1, Hq = 2, Hkv = 1, D = 8, Tq = int64_t(qp.size()), Tk = int64_t(kp.size());
  Tensor q = meta({B * Tq, Hq * D}), k = meta({B * Tk, Hkv * D}), v = meta({B * Tk, Hkv * D});
  Tensor out = meta({B * Tq, Hq * D}), lse = meta({B, Hq, Tq});
  const ops::AttentionBlock s{B, Hq, Hkv, &qp, &kp};
  Recorded r;
  ops::attention_block_forward(s, q, k, v, out, lse);
  ASSERT_EQ(r.works.size(), 1u);
  const int64_t entries = brute_force_entries(qp, kp);
  EXPECT_EQ(entries, cpu::tiled_entries(qp.data(), Tq, kp.data(), Tk));
  EXPECT_GT(entries, 0);
  EXPECT_EQ(r.works[0].flops, 4.0 * B * Hq * D * double(entries));
  // Keys all after the queries: nothing computed.
  const std::vector<int64_t> late = iota(Tk, 1000);
  const ops::AttentionBlock none{B, Hq, Hkv, &qp, &late};
  ops::attention_block_forward(none, q, k, v, out, lse);
  ASSERT_EQ(r.works.size(), 2u);
  EXPECT_EQ(r.works[1].flops, 0);
}

TEST(OpsWork, GlaFollowsItsChunkAlgorithm) {
  // One chunk of 64 tokens in sub-chunks of 16: 6 whole off-diagonal sub-chunk pairs and 4
  // diagonal triangles of scores, then the state products of every token.
  const int64_t B = 1, H = 2, Hkv = 1, K = 16, V = 16, T = 64;
  Tensor q = meta({B * T, H * K}), k = meta({B * T, Hkv * K}), v = meta({B * T, Hkv * V}),
         gk = meta({B * T, Hkv * K}), o = meta({B * T, H * V});
  const ops::Gla s{B, H, Hkv, 64, 16};
  Recorded r;
  Tensor ht;
  ops::gla_forward(s, q, k, v, gk, Tensor(), o, ht);
  Tensor dq = meta(q.shape()), dk = meta(k.shape()), dv = meta(v.shape()), dgk = meta(gk.shape()),
         dh0;
  ops::gla_backward(s, q, k, v, gk, Tensor(), o, Tensor(), dq, dk, dv, dgk, dh0);
  ASSERT_EQ(r.works.size(), 2u);
  const double entries = 6 * 16 * 16 + 4 * 16 * 17 / 2;
  EXPECT_EQ(r.works[0].flops, B * H * (entries * (2 * K + 2 * V) + 4.0 * T * K * V));
  EXPECT_EQ(r.works[1].flops, B * H * (entries * (6 * K + 4 * V) + 10.0 * T * K * V));
}

TEST(OpsWork, FusedCrossEntropyIsItsGemmsAndTheSoftmax) {
  const int64_t N = 32, D = 16, V = 100;
  ops::LinearCrossEntropy a;
  a.x = meta({N, D});
  a.w = meta({V, D});
  a.dx = meta({N, D});
  a.dw = meta({V, D});
  a.targets = meta({N}, DType::i32);
  a.V = V;
  Recorded r;
  ops::linear_cross_entropy(a);
  ASSERT_EQ(r.works.size(), 4u);
  double gemm_flops = 0;
  for (const ops::KernelWork& g : r.works) {
    EXPECT_EQ(std::string(g.op), "linear_cross_entropy");
    if (g.m) gemm_flops += g.flops;
  }
  EXPECT_EQ(gemm_flops, 3 * 2.0 * N * D * V);
}

TEST(OpsWork, MemoryBoundOpsReportTheirBytes) {
  const int64_t M = 10, d = 8;
  Tensor x = meta({M, d}), w = meta({d}), y = meta({M, d}, DType::bf16), rstd = meta({M});
  Recorded r;
  ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
  ASSERT_EQ(r.works.size(), 1u);
  EXPECT_EQ(std::string(r.works[0].op), "rmsnorm_forward");
  EXPECT_EQ(r.works[0].bytes, double(M * d * 4 + M * d * 2 + M * 4));
  EXPECT_EQ(r.works[0].m, 0);
}

// CPU offload's transfers: a copy or cast between the host pool and the device names its
// direction and what crosses (the smaller side: a GPU casts where the transfer is smaller); the
// offloaded gradient's accumulation of a device buffer is device_to_host.
TEST(OpsWork, CopiesAcrossPoolsAreTransfers) {
  const int64_t n = 1000;
  Tensor master = Tensor::empty({n}, DType::f32, Device::meta, Pool::host);
  Tensor gathered = meta({n}, DType::bf16), full = meta({n}), same = meta({n});
  Recorded r;
  ops::copy(master, gathered);  // f32 host -> bf16 device
  ops::copy(master, full);      // f32 host -> f32 device
  ops::copy(full, same);        // within the device
  ops::add_inplace(master, full);
  ops::add_inplace(same, full);
  ASSERT_EQ(r.works.size(), 5u);
  const char* names[] = {"host_to_device", "host_to_device", "copy", "device_to_host",
                         "add_inplace"};
  const double link[] = {2.0 * n, 4.0 * n, 0, 4.0 * n, 0};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(std::string(r.works[i].op), names[i]) << i;
    EXPECT_EQ(r.works[i].link_bytes, link[i]) << i;
  }
  EXPECT_EQ(r.works[1].bytes, 8.0 * n);
}

TEST(OpsWork, NothingOnCpuOrWithoutARecorder) {
  const int64_t M = 4, N = 3, K = 2;
  int count = 0;
  {
    ops::RecordWork record([&](const ops::KernelWork&) { ++count; });
    Tensor x = Tensor::empty({M, K}, DType::f32), w = Tensor::empty({N, K}, DType::f32);
    Tensor y = Tensor::empty({M, N}, DType::f32);
    ops::fill(x, 1.0f);
    ops::fill(w, 2.0f);
    ops::linear(x, w, y);
    EXPECT_EQ(count, 0);
    EXPECT_THROW(ops::RecordWork again([](const ops::KernelWork&) {}), Error);
  }
  Tensor x = meta({M, K}), w = meta({N, K}), y = meta({M, N});
  ops::linear(x, w, y);  // the recorder is gone
  EXPECT_EQ(count, 0);
}
