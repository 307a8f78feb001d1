// The CUDA flash attention kernels (kernels/cuda/flash_attention_kernels.cuh), run on the CPU by
// the host emulation of their device primitives (tests/kernels/flash_emulation.hpp: each CUDA
// thread a fiber, mma.sync and ldmatrix by the PTX ISA's fragment layouts, cp.async landing only
// at its wait), against the CPU's bf16 attention kernels (kernels/cpu/attention_bf16.hpp) on the
// same inputs: random (never zeros), odd lengths (not multiples of the 64-row tile), GQA and
// Hq = Hkv, head dims 64 and 128, q, k, v as strided views with padding between tokens; plain
// causal attention and blocks with arbitrary, unsorted positions including rows that see no key
// (out exactly 0, lse -inf) and key tiles no query sees; f32 and bf16 outputs; the backward
// overwriting (into NaN sentinels: an element the kernel misses fails) and accumulating (into
// random values).
//
// Bounds: those tests/kernels/attention_bf16_test.cpp sets between the bf16 and the f32 kernels
// (out 4e-3, dv 5e-3, dq and dk 1.5e-2 relative L2, lse 1e-5 relative), and, since the kernel and
// the CPU round at the same points, the bound that test sets between the CPU's own bf16 variants
// (2e-4: sums in another order, a P or dS on the other side of a bf16 rounding boundary) for out,
// dq, dk, dv: a rounding skipped or added fails. Measured (printed): 1e-8 to 3e-7, out16 up to
// 2e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_bf16.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "tests/kernels/flash_emulation.hpp"
#include "tests/kernels/flash_test_util.hpp"
#include "tests/test_util.hpp"
// The kernel bodies, after the emulated primitives they call.
#include "kernels/cuda/flash_attention_kernels.cuh"

using namespace loom;
using cpu::AttentionShape;
using cpu::BlockShape;

namespace {

using namespace test::flash;  // the bounds, columns
constexpr double kVariantTol = 2e-4;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

const uint16_t* bits(const std::vector<bf16>& v, int64_t offset = 0) {
  return reinterpret_cast<const uint16_t*>(v.data() + offset);
}

// Per-tile position ranges as the device pre-pass computes them (empty: plain causal).
std::vector<int64_t> host_ranges(const std::vector<int64_t>& pos, int64_t n) {
  std::vector<int64_t> r;
  if (pos.empty()) return r;
  const int tiles = int((n + flash::kTile - 1) / flash::kTile);
  r.resize(size_t(2 * tiles));
  for (int t = 0; t < tiles; ++t) flash::tile_range(pos.data(), n, t, r.data());
  return r;
}

// One test case: a block of Tq queries against Tk keys (positions empty: plain causal, Tq = Tk).
// q [B*Tq, q_stride], k and v views into one [B*Tk, kv_stride] buffer; strides padded by 8.
struct Case {
  int64_t B, Tq, Tk, Hq, Hkv, D;
  std::vector<int64_t> q_pos, k_pos;
  int64_t qs() const { return Hq * D + 8; }
  int64_t kvs() const { return 2 * Hkv * D + 8; }
  int64_t voff() const { return Hkv * D; }
  float scale() const { return 1.0f / std::sqrt(float(D)); }
  BlockShape shape(bool accumulate) const {
    return {B, Tq, Tk, Hq, Hkv, D, qs(), kvs(), scale(), accumulate};
  }
  std::string name() const {
    return "B=" + std::to_string(B) + " Tq=" + std::to_string(Tq) + " Tk=" + std::to_string(Tk) +
           " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D) +
           (q_pos.empty() ? " causal" : " block");
  }
  const int64_t* qp() const { return q_pos.empty() ? nullptr : q_pos.data(); }
  const int64_t* kp() const { return k_pos.empty() ? nullptr : k_pos.data(); }
};

template <int D, int W>
void emu_forward(const Case& c, const std::vector<bf16>& q, const std::vector<bf16>& kv,
                 float* out_f32, uint16_t* out_bf16, float* lse) {
  const std::vector<int64_t> qr = host_ranges(c.q_pos, c.Tq), kr = host_ranges(c.k_pos, c.Tk);
  flash::FwdParams p{};
  p.q = bits(q), p.k = bits(kv), p.v = bits(kv, c.voff());
  p.q_pos = c.qp(), p.k_pos = c.kp();
  p.q_rng = qr.empty() ? nullptr : qr.data(), p.k_rng = kr.empty() ? nullptr : kr.data();
  p.out_f32 = out_f32, p.out_bf16 = out_bf16, p.lse = lse;
  p.Tq = c.Tq, p.Tk = c.Tk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.q_stride = c.qs(), p.kv_stride = c.kvs();
  p.c = c.scale() * flash::kLog2e;
  p.q_tiles = int((c.Tq + 63) / 64), p.k_tiles = int((c.Tk + 63) / 64);
  flash::emu::run_grid(flash::blocks_of<W>(p.q_tiles), int(c.B * c.Hq), flash::kThreadsOf<W>,
                       flash::fwd_smem_bytes<D, W>(), [&](int bx, int by, int tid, char* smem) {
                         flash::forward_block<D, W>(p, bx, by, tid, smem);
                       });
}

template <int D, int W>
void emu_backward(const Case& c, bool accumulate, const std::vector<bf16>& q,
                  const std::vector<bf16>& kv, const std::vector<float>& lse,
                  const std::vector<float>& delta, const std::vector<float>& dout, float* dq,
                  float* dkv) {
  const std::vector<int64_t> qr = host_ranges(c.q_pos, c.Tq), kr = host_ranges(c.k_pos, c.Tk);
  std::vector<bf16> dob(dout.size());
  for (size_t i = 0; i < dout.size(); ++i) dob[i] = float_to_bf16(dout[i]);
  flash::BwdParams p{};
  p.q = bits(q), p.k = bits(kv), p.v = bits(kv, c.voff()), p.dout = bits(dob);
  p.q_pos = c.qp(), p.k_pos = c.kp();
  p.q_rng = qr.empty() ? nullptr : qr.data(), p.k_rng = kr.empty() ? nullptr : kr.data();
  p.lse = lse.data(), p.delta = delta.data();
  p.dq = dq, p.dk = dkv, p.dv = dkv + c.voff();
  p.Tq = c.Tq, p.Tk = c.Tk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.q_stride = c.qs(), p.kv_stride = c.kvs();
  p.c = c.scale() * flash::kLog2e, p.scale = c.scale(), p.accumulate = accumulate;
  p.q_tiles = int((c.Tq + 63) / 64), p.k_tiles = int((c.Tk + 63) / 64);
  flash::emu::run_grid(flash::blocks_of<W>(p.k_tiles), int(c.B * c.Hkv), flash::kThreadsOf<W>,
                       flash::bwd_kv_smem_bytes<D, W>(), [&](int bx, int by, int tid, char* smem) {
                         flash::backward_kv_block<D, W>(p, bx, by, tid, smem);
                       });
  flash::emu::run_grid(flash::blocks_of<W>(p.q_tiles), int(c.B * c.Hq), flash::kThreadsOf<W>,
                       flash::bwd_q_smem_bytes<D, W>(), [&](int bx, int by, int tid, char* smem) {
                         flash::backward_q_block<D, W>(p, bx, by, tid, smem);
                       });
}

void expect_lse(const std::vector<float>& a, const std::vector<float>& ref, const std::string& n) {
  double err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(a[i], ref[i]) << n << " lse " << i;
      continue;
    }
    err = std::max(err, std::abs(double(a[i]) - ref[i]) / std::max(1.0, std::abs(double(ref[i]))));
  }
  EXPECT_LT(err, kLseTol) << n << " lse";
  std::printf("  lse %.2e", err);
}

void expect_rel(const std::vector<float>& a, const std::vector<float>& ref, double tol,
                const std::string& what) {
  const double e = test::rel_l2(a, ref);
  EXPECT_LT(e, tol) << what;  // NaN (a missed element) fails too
  EXPECT_LT(e, kVariantTol) << what;
  std::printf("  %s %.2e", what.c_str(), e);
}

// Forward (f32 and bf16 outputs) and backward (overwriting and accumulating) of one case against
// the CPU's bf16 kernels, with blocks of W warps (4 or 8).
template <int W>
void check_case(const Case& c, uint64_t seed, float input_scale) {
  SCOPED_TRACE(c.name() + " W=" + std::to_string(W));
  std::printf("%s W=%d:", c.name().c_str(), W);
  const int64_t qrows = c.B * c.Tq, krows = c.B * c.Tk, ow = c.Hq * c.D, kw = c.Hkv * c.D;
  const std::vector<bf16> q = test::to_bf16(test::randn(size_t(qrows * c.qs()), seed, input_scale));
  const std::vector<bf16> kv =
      test::to_bf16(test::randn(size_t(krows * c.kvs()), seed + 1, input_scale));
  const std::vector<float> dout = test::randn(size_t(qrows * ow), seed + 2);
  const BlockShape s = c.shape(true);
  const AttentionShape as{c.B, c.Tq, c.Hq, c.Hkv, c.D, c.qs(), c.kvs(), c.scale()};
  const bool block = !c.q_pos.empty();

  // Forward: the CPU's f32 and bf16 outputs.
  std::vector<float> out(size_t(qrows * ow)), lse(size_t(c.B * c.Hq * c.Tq));
  std::vector<bf16> out16(out.size());
  if (block) {
    cpu::attention_block_forward_bf16(s, q.data(), kv.data(), kv.data() + c.voff(), c.qp(), c.kp(),
                                      out.data(), lse.data());
    for (size_t i = 0; i < out.size(); ++i) out16[i] = float_to_bf16(out[i]);
  } else {
    cpu::attention_forward_bf16(as, q.data(), kv.data(), kv.data() + c.voff(), out.data(),
                                lse.data());
    std::vector<float> lse2(lse.size());
    cpu::attention_forward_bf16(as, q.data(), kv.data(), kv.data() + c.voff(), out16.data(),
                                lse2.data());
  }
  std::vector<float> eout(out.size(), kNaN), flse(lse.size(), kNaN);
  std::vector<uint16_t> eout16(out.size(), 0x7fc0);  // NaN
  std::vector<float> flse2(lse.size(), kNaN);
  auto fwd = c.D == 64 ? emu_forward<64, W> : emu_forward<128, W>;
  fwd(c, q, kv, eout.data(), nullptr, flse.data());
  fwd(c, q, kv, nullptr, eout16.data(), flse2.data());
  expect_rel(eout, out, kFwdTol, "out");
  expect_lse(flse, lse, c.name());
  EXPECT_EQ(flse2, flse) << "the bf16-output forward's lse";
  std::vector<float> w16(out.size()), r16(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    w16[i] = bf16_to_float(bf16{eout16[i]});
    r16[i] = bf16_to_float(out16[i]);
    // The bf16 output is the f32 output rounded as written.
    ASSERT_EQ(eout16[i], float_to_bf16(eout[i]).bits) << "out16 " << i;
  }
  expect_rel(w16, r16, kFwdTol, "out16");
  // Rows that see no key: out exactly 0.
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Tq; ++i) {
        if (!std::isinf(lse[size_t((b * c.Hq + h) * c.Tq + i)])) continue;
        for (int64_t d = 0; d < c.D; ++d)
          ASSERT_EQ(eout[size_t((b * c.Tq + i) * ow + h * c.D + d)], 0.0f) << "row " << i;
      }

  // Backward from the CPU's lse and delta (of its output rounded to bf16, as the model saves it).
  std::vector<float> delta(lse.size());
  cpu::attention_delta_bf16(c.B, c.Tq, c.Hq, c.D, out16.data(), dout.data(), delta.data());
  auto bwd = c.D == 64 ? emu_backward<64, W> : emu_backward<128, W>;
  for (bool accumulate : {false, true}) {
    if (accumulate && !block) continue;  // plain attention overwrites
    const float init = accumulate ? 0.0f : kNaN;
    std::vector<float> dq(size_t(qrows * c.qs()), init), dkv(size_t(krows * c.kvs()), init);
    if (accumulate) {  // random starting values, the same for both
      dq = test::randn(dq.size(), seed + 3);
      dkv = test::randn(dkv.size(), seed + 4);
    }
    std::vector<float> rq = dq, rkv = dkv;
    if (block) {
      cpu::attention_block_backward_bf16(
          c.shape(accumulate), q.data(), kv.data(), kv.data() + c.voff(), c.qp(), c.kp(),
          lse.data(), delta.data(), dout.data(), rq.data(), rkv.data(), rkv.data() + c.voff());
    } else {
      cpu::attention_backward_bf16(as, q.data(), kv.data(), kv.data() + c.voff(), out16.data(),
                                   lse.data(), dout.data(), rq.data(), rkv.data(),
                                   rkv.data() + c.voff());
    }
    bwd(c, accumulate, q, kv, lse, delta, dout, dq.data(), dkv.data());
    std::printf(accumulate ? "  | acc" : "  | bwd");
    expect_rel(columns(dq, qrows, c.qs(), 0, ow), columns(rq, qrows, c.qs(), 0, ow), kDqkTol, "dq");
    expect_rel(columns(dkv, krows, c.kvs(), 0, kw), columns(rkv, krows, c.kvs(), 0, kw), kDqkTol,
               "dk");
    expect_rel(columns(dkv, krows, c.kvs(), kw, kw), columns(rkv, krows, c.kvs(), kw, kw), kDvTol,
               "dv");
  }
  std::printf("\n");
}

// Both block sizes the launch can take.
void check_case(const Case& c, uint64_t seed, float input_scale = 1.0f) {
  check_case<4>(c, seed, input_scale);
  check_case<8>(c, seed, input_scale);
}

TEST(FlashAttentionEmulation, CausalMatchesCpuKernels) {
  check_case({2, 77, 77, 4, 2, 64, {}, {}}, 11);          // GQA 2, a partial second tile, B 2
  check_case({1, 130, 130, 2, 2, 64, {}, {}}, 12, 2.5f);  // Hq = Hkv, three tiles, large scores
  check_case({1, 70, 70, 2, 1, 128, {}, {}}, 13);         // Llama 8B's head dim, GQA 2
  check_case({1, 1, 1, 2, 1, 64, {}, {}}, 14);            // one token
}

// Queries at unsorted positions, some before every key (no key: out 0, lse -inf); keys unsorted
// and shifted, a key tile that straddles the queries, a key tile no query sees.
TEST(FlashAttentionEmulation, BlockMatchesCpuKernels) {
  std::mt19937_64 rng(7);
  for (int64_t D : {64, 128}) {
    Case c{1, 70, 150, 4, 2, D, {}, {}};
    c.q_pos.resize(size_t(c.Tq));
    c.k_pos.resize(size_t(c.Tk));
    std::iota(c.k_pos.begin(), c.k_pos.end(), int64_t(20));
    std::shuffle(c.k_pos.begin(), c.k_pos.begin() + 128, rng);  // two mixed tiles
    // The last (partial) key tile at positions past every query: skipped.
    for (int64_t j = 128; j < c.Tk; ++j) c.k_pos[size_t(j)] = 1000 + j;
    std::uniform_int_distribution<int64_t> u(0, 160);
    for (int64_t& p : c.q_pos) p = u(rng);
    c.q_pos[3] = 5, c.q_pos[40] = 19;  // before every key
    check_case(c, 20 + uint64_t(D));
  }
}

}  // namespace
