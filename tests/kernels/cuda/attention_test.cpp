// The CUDA attention (kernels/cuda/attention.hpp: the exact path, and for the bf16 cases at head
// dims 64 and 128 the flash kernels of flash_attention.hpp) against the CPU kernels
// (kernels/cpu/attention.hpp, attention_bf16.hpp, attention_block.hpp): q, k, v as strided views
// inside one fused [B*T, (Hq+2Hkv)*D] buffer, random inputs (never zeros), every output filled with
// NaN first so that an element the kernel missed fails, odd T (1, 7, 65), head dims 64, 128 and
// 40, GQA (Hq 4 over Hkv 2) and Hq = Hkv, B 2, and the Llama 3.2 1B (Hq 32, Hkv 8, D 64) and
// Llama 3 8B (D 128) shapes at T 256. The block variants with zigzag positions (a later chunk of
// queries, the diagonal block, rows that see no key, a fully masked pair, unsorted positions),
// overwriting and accumulating; attention_merge and attention_delta.
//
// f32 against the CPU's f32 within 1e-5 relative L2 (both are within a few 1e-7 of fp64). bf16
// within the bounds tests/kernels/attention_bf16_test.cpp sets for the CPU's bf16 kernels against
// fp64 and the f32 kernels, against both the CPU's bf16 kernels and its f32 kernels; and the
// backward closer to the CPU's bf16 kernels than to the f32 ones (a rounding skipped or added).
#include "kernels/cuda/attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_bf16.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cuda/gemm.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using cpu::AttentionShape;
using cpu::BlockShape;

namespace {

using test::same_bits;
using test::widen;

// f32 exact (TF32 off) for the whole test, whatever another test left.
class AttentionCuda : public test::CudaTest {
 protected:
  void SetUp() override {
    test::CudaTest::SetUp();
    prev_tf32_ = cuda::allow_tf32();
    cuda::set_allow_tf32(false);
  }
  void TearDown() override { cuda::set_allow_tf32(prev_tf32_); }

 private:
  bool prev_tf32_ = false;
};

constexpr double kTol = 1e-5;  // f32 against the CPU's f32, relative L2
// attention_bf16_test.cpp's bounds (bf16 rounding of P, dS and dout; see there).
constexpr double kFwdTol = 4e-3;
constexpr double kLseTol = 1e-5;
constexpr double kDvTol = 5e-3;
constexpr double kDqkTol = 1.5e-2;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Dims {
  int64_t B, T, Hq, Hkv, D;
  int64_t stride() const { return (Hq + 2 * Hkv) * D; }  // the fused qkv row
  int64_t koff() const { return Hq * D; }
  int64_t voff() const { return (Hq + Hkv) * D; }
  int64_t rows() const { return B * T; }
  float scale() const { return 1.0f / std::sqrt(float(D)); }
  AttentionShape shape() const { return {B, T, Hq, Hkv, D, stride(), stride(), scale()}; }
};
std::string name(const Dims& d) {
  return "B=" + std::to_string(d.B) + " T=" + std::to_string(d.T) + " Hq=" + std::to_string(d.Hq) +
         " Hkv=" + std::to_string(d.Hkv) + " D=" + std::to_string(d.D);
}

// Odd T (one key, a partial tile, past one 64-key tile of the CPU), GQA and not, head dims 64, 128
// and 40, then Llama 3.2 1B's and Llama 3 8B's heads.
const std::vector<Dims> kShapes = {
    {2, 1, 4, 2, 64},   {2, 7, 4, 2, 64},    {2, 65, 4, 2, 64},
    {2, 65, 4, 4, 128}, {2, 7, 4, 4, 128},   {2, 65, 4, 2, 40},
    {2, 130, 2, 1, 64}, {2, 256, 32, 8, 64}, {1, 256, 32, 8, 128},
};

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}
// The values rounded to bf16 (so that the f32 and bf16 kernels see the same inputs).
std::vector<float> rounded(const std::vector<float>& v) {
  return widen(to_bf16(v));
}

// Columns [off, off + width) of every row of a [rows, stride] buffer.
std::vector<float> columns(const std::vector<float>& buf, int64_t rows, int64_t stride, int64_t off,
                           int64_t width) {
  std::vector<float> out;
  out.reserve(size_t(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    out.insert(out.end(), buf.begin() + r * stride + off, buf.begin() + r * stride + off + width);
  return out;
}

// lse: -inf exactly where the CPU has -inf (rows that see no key), elsewhere finite and within
// `tol` relative (to max(1, |lse|): lse of scores near 0 has an absolute rounding).
void expect_lse_near(const std::vector<float>& got, const std::vector<float>& want, double tol,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == -kInf) {
      if (got[i] != -kInf && ++bad <= 5) ADD_FAILURE() << what << " lse " << i << ": " << got[i];
      continue;
    }
    if (!std::isfinite(got[i])) {
      if (++bad <= 5) ADD_FAILURE() << what << " lse " << i << ": " << got[i];
      continue;
    }
    err = std::max(err,
                   std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i]))));
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_LE(err, tol) << what << " lse";
}

// The three gradients of a backward run, dense.
struct Grads {
  std::vector<float> dq, dk, dv;
};
Grads split(const Dims& d, const std::vector<float>& grad) {
  return {columns(grad, d.rows(), d.stride(), 0, d.Hq * d.D),
          columns(grad, d.rows(), d.stride(), d.koff(), d.Hkv * d.D),
          columns(grad, d.rows(), d.stride(), d.voff(), d.Hkv * d.D)};
}

// dq and dk against a reference: where T = 1 they are zero up to rounding (one key: P = 1,
// dS = 0), so absolutely; otherwise relative L2.
void expect_grads(const Dims& d, const Grads& got, const Grads& want, double qk_tol, double v_tol,
                  const std::string& what) {
  if (d.T == 1) {
    EXPECT_LE(test::max_abs_diff(got.dq, want.dq), 1e-5) << what << " dq";
    EXPECT_LE(test::max_abs_diff(got.dk, want.dk), 1e-5) << what << " dk";
  } else {
    EXPECT_LE(test::rel_l2(got.dq, want.dq), qk_tol) << what << " dq";
    EXPECT_LE(test::rel_l2(got.dk, want.dk), qk_tol) << what << " dk";
  }
  EXPECT_LE(test::rel_l2(got.dv, want.dv), v_tol) << what << " dv";
}

// ---- plain causal attention, f32 ---------------------------------------------------------------

TEST_F(AttentionCuda, ForwardF32MatchesCpu) {
  uint64_t seed = 1;
  for (const Dims& d : kShapes)
    for (const float input_scale : {1.0f, 3.0f}) {  // 3: scores of std ~9
      SCOPED_TRACE(name(d) + " input_scale " + std::to_string(input_scale));
      const AttentionShape s = d.shape();
      const auto qkv = test::randn(size_t(d.rows() * d.stride()), seed++, input_scale);
      std::vector<float> out(size_t(d.rows() * d.Hq * d.D)), lse(size_t(d.B * d.Hq * d.T));
      cpu::attention_forward(s, qkv.data(), qkv.data() + d.koff(), qkv.data() + d.voff(),
                             out.data(), lse.data());
      const Tensor x = test::to_device(qkv);
      const Tensor o = test::nan_device(int64_t(out.size())),
                   l = test::nan_device(int64_t(lse.size()));
      const float* base = x.data<float>();
      cuda::attention_forward(s, base, base + d.koff(), base + d.voff(), o.data<float>(),
                              l.data<float>());
      EXPECT_LE(test::rel_l2(test::to_host(o), out), kTol) << "out";
      expect_lse_near(test::to_host(l), lse, kTol, "f32");
    }
}

// The backward OVERWRITES dq, dk, dv: the fused gradient buffer starts as NaN.
TEST_F(AttentionCuda, BackwardF32MatchesCpu) {
  uint64_t seed = 100;
  for (const Dims& d : kShapes) {
    SCOPED_TRACE(name(d));
    const AttentionShape s = d.shape();
    const auto qkv = test::randn(size_t(d.rows() * d.stride()), seed++);
    const auto dout = test::randn(size_t(d.rows() * d.Hq * d.D), seed++);
    std::vector<float> out(dout.size()), lse(size_t(d.B * d.Hq * d.T));
    cpu::attention_forward(s, qkv.data(), qkv.data() + d.koff(), qkv.data() + d.voff(), out.data(),
                           lse.data());
    std::vector<float> grad(qkv.size(), 7.0f);
    cpu::attention_backward(s, qkv.data(), qkv.data() + d.koff(), qkv.data() + d.voff(), out.data(),
                            lse.data(), dout.data(), grad.data(), grad.data() + d.koff(),
                            grad.data() + d.voff());
    const Tensor x = test::to_device(qkv), o = test::to_device(out), l = test::to_device(lse),
                 g = test::to_device(dout), dx = test::nan_device(int64_t(qkv.size()));
    const float* base = x.data<float>();
    float* gb = dx.data<float>();
    cuda::attention_backward(s, base, base + d.koff(), base + d.voff(), o.data<float>(),
                             l.data<float>(), g.data<float>(), gb, gb + d.koff(), gb + d.voff());
    expect_grads(d, split(d, test::to_host(dx)), split(d, grad), kTol, kTol, "f32");
  }
}

// ---- plain causal attention, bf16 --------------------------------------------------------------

// The bf16 forward against the CPU's bf16 and f32 forwards on the same (rounded) inputs; the
// bf16-output variant is the f32 output rounded, bit for bit, with the same lse.
TEST_F(AttentionCuda, ForwardBf16MatchesCpu) {
  uint64_t seed = 200;
  for (const Dims& d : kShapes) {
    SCOPED_TRACE(name(d));
    const AttentionShape s = d.shape();
    const auto qkv = rounded(test::randn(size_t(d.rows() * d.stride()), seed++));
    const auto qkv16 = to_bf16(qkv);
    const size_t n_out = size_t(d.rows() * d.Hq * d.D), n_lse = size_t(d.B * d.Hq * d.T);
    std::vector<float> out(n_out), lse(n_lse), fout(n_out), flse(n_lse), lse2(n_lse);
    std::vector<bf16> out16(n_out);
    cpu::attention_forward_bf16(s, qkv16.data(), qkv16.data() + d.koff(), qkv16.data() + d.voff(),
                                out.data(), lse.data());
    cpu::attention_forward_bf16(s, qkv16.data(), qkv16.data() + d.koff(), qkv16.data() + d.voff(),
                                out16.data(), lse2.data());
    cpu::attention_forward(s, qkv.data(), qkv.data() + d.koff(), qkv.data() + d.voff(), fout.data(),
                           flse.data());

    const Tensor x = test::to_device(qkv, DType::bf16);
    const bf16* base = x.data<bf16>();
    const Tensor o = test::nan_device(int64_t(n_out)), l = test::nan_device(int64_t(n_lse));
    cuda::attention_forward_bf16(s, base, base + d.koff(), base + d.voff(), o.data<float>(),
                                 l.data<float>());
    const Tensor o16 = test::nan_device(int64_t(n_out), DType::bf16),
                 l16 = test::nan_device(int64_t(n_lse));
    cuda::attention_forward_bf16(s, base, base + d.koff(), base + d.voff(), o16.data<bf16>(),
                                 l16.data<float>());
    const auto got = test::to_host(o), got_lse = test::to_host(l);
    EXPECT_LE(test::rel_l2(got, out), kFwdTol) << "out against the CPU's bf16";
    EXPECT_LE(test::rel_l2(got, fout), kFwdTol) << "out against the CPU's f32";
    expect_lse_near(got_lse, lse, kLseTol, "bf16 against the CPU's bf16");
    expect_lse_near(got_lse, flse, kLseTol, "bf16 against the CPU's f32");
    const auto got16 = test::to_host_bf16(o16);
    EXPECT_TRUE(same_bits(got16, to_bf16(got))) << "the bf16 out is not the f32 out rounded";
    EXPECT_EQ(test::to_host(l16), got_lse) << "the bf16-output variant's lse differs";
    EXPECT_LE(test::rel_l2(widen(got16), widen(out16)), kFwdTol) << "bf16 out";
    // Up to 64 keys the CPU's online softmax rounds P against the final max too: the same
    // roundings, so much closer to the CPU's bf16 than the bf16 rounding itself.
    if (d.T > 1 && d.T <= 64) {
      EXPECT_LE(test::rel_l2(got, out), 0.5 * test::rel_l2(out, fout))
          << "closer to the CPU's f32 than to its bf16: is P rounded?";
    }
  }
}

// The bf16 backward (dout rounded to bf16 inside, as the CPU's) against the CPU's bf16 backward on
// the same inputs, and against the CPU's f32 backward on the f32 forward's (rounded) output.
TEST_F(AttentionCuda, BackwardBf16MatchesCpu) {
  uint64_t seed = 300;
  for (const Dims& d : kShapes) {
    SCOPED_TRACE(name(d));
    const AttentionShape s = d.shape();
    const auto qkv = rounded(test::randn(size_t(d.rows() * d.stride()), seed++));
    const auto qkv16 = to_bf16(qkv);
    const auto dout = test::randn(size_t(d.rows() * d.Hq * d.D), seed++);  // not bf16 values
    const size_t n_lse = size_t(d.B * d.Hq * d.T);
    std::vector<float> out(dout.size()), lse(n_lse), fout(dout.size()), flse(n_lse);
    cpu::attention_forward_bf16(s, qkv16.data(), qkv16.data() + d.koff(), qkv16.data() + d.voff(),
                                out.data(), lse.data());
    const auto out16 = to_bf16(out);
    std::vector<float> grad(qkv.size(), 7.0f);
    cpu::attention_backward_bf16(s, qkv16.data(), qkv16.data() + d.koff(), qkv16.data() + d.voff(),
                                 out16.data(), lse.data(), dout.data(), grad.data(),
                                 grad.data() + d.koff(), grad.data() + d.voff());
    cpu::attention_forward(s, qkv.data(), qkv.data() + d.koff(), qkv.data() + d.voff(), fout.data(),
                           flse.data());
    const auto fout_r = rounded(fout);  // what the bf16 path saves
    std::vector<float> fgrad(qkv.size(), 7.0f);
    cpu::attention_backward(s, qkv.data(), qkv.data() + d.koff(), qkv.data() + d.voff(),
                            fout_r.data(), flse.data(), dout.data(), fgrad.data(),
                            fgrad.data() + d.koff(), fgrad.data() + d.voff());

    const Tensor x = test::to_device(qkv, DType::bf16), o = test::to_device(out, DType::bf16),
                 l = test::to_device(lse), g = test::to_device(dout),
                 dx = test::nan_device(int64_t(qkv.size()));
    const bf16* base = x.data<bf16>();
    float* gb = dx.data<float>();
    cuda::attention_backward_bf16(s, base, base + d.koff(), base + d.voff(), o.data<bf16>(),
                                  l.data<float>(), g.data<float>(), gb, gb + d.koff(),
                                  gb + d.voff());
    const Grads got = split(d, test::to_host(dx)), cpu16 = split(d, grad), f32 = split(d, fgrad);
    expect_grads(d, got, cpu16, kDqkTol, kDvTol, "against the CPU's bf16");
    expect_grads(d, got, f32, kDqkTol, kDvTol, "against the CPU's f32");
    // The same P and dS from the same lse: the roundings land alike, far closer than the bf16
    // rounding itself (what separates the CPU's bf16 from its f32).
    EXPECT_LE(test::rel_l2(got.dv, cpu16.dv), 0.5 * test::rel_l2(cpu16.dv, f32.dv)) << "dv";
    if (d.T > 1) {
      EXPECT_LE(test::rel_l2(got.dq, cpu16.dq), 0.5 * test::rel_l2(cpu16.dq, f32.dq)) << "dq";
      EXPECT_LE(test::rel_l2(got.dk, cpu16.dk), 0.5 * test::rel_l2(cpu16.dk, f32.dk)) << "dk";
    }
  }
}

// ---- block attention (global positions) --------------------------------------------------------

Tensor positions_device(const std::vector<int64_t>& p) {
  Tensor h = Tensor::empty({int64_t(2 * p.size())}, DType::i32);
  std::memcpy(h.raw(), p.data(), p.size() * sizeof(int64_t));
  Tensor d = Tensor::empty({int64_t(2 * p.size())}, DType::i32, Device::cuda);
  d.copy_from(h);
  return d;
}
const int64_t* pos_of(const Tensor& t) {
  return static_cast<const int64_t*>(t.raw());
}

// Chunks of C positions: chunk c is [c*C, (c+1)*C); the zigzag layout of cp ranks gives rank r
// chunks r and 2*cp-1-r.
std::vector<int64_t> chunks(std::initializer_list<int64_t> which, int64_t C) {
  std::vector<int64_t> p;
  for (const int64_t c : which)
    for (int64_t t = 0; t < C; ++t) p.push_back(c * C + t);
  return p;
}

struct BlockCase {
  std::string name;
  std::vector<int64_t> qp, kp;
};
// C = 33 (cp 4, 8 chunks): queries and keys of different ranks.
std::vector<BlockCase> block_cases() {
  constexpr int64_t C = 33;
  std::vector<BlockCase> cases = {
      {"diagonal (rank 1 against itself)", chunks({1, 6}, C), chunks({1, 6}, C)},
      {"later queries (rank 2 against rank 0)", chunks({2, 5}, C), chunks({0, 7}, C)},
      {"some rows empty (rank 0 against rank 1)", chunks({0, 7}, C), chunks({1, 6}, C)},
      {"fully visible, Tq != Tk", chunks({5}, C), chunks({2, 3}, C)},
      {"fully masked", chunks({1}, C), chunks({4}, C)},
  };
  BlockCase u{"unsorted", chunks({1, 6}, C), chunks({2, 5}, C)};
  std::mt19937_64 rng(5);
  std::shuffle(u.qp.begin(), u.qp.end(), rng);
  std::shuffle(u.kp.begin(), u.kp.end(), rng);
  cases.push_back(u);
  return cases;
}

// Dims of the block tests: B, Hq, Hkv, D.
struct BlockDims {
  int64_t B, Hq, Hkv, D;
};
const std::vector<BlockDims> kBlockDims = {{2, 4, 2, 64}, {2, 4, 4, 128}};

// q [B*Tq, Hq*D + 8] (a strided view), k and v in one [B*Tk, 2*Hkv*D] buffer, as a ring step
// holds them; every input rounded to bf16 values so that the f32 and bf16 kernels share them.
struct BlockData {
  BlockShape s;
  std::vector<float> q, kv, dout, lse, delta, dq0, dkv0;
  int64_t q_size() const { return s.B * s.Tq * s.q_stride; }
  int64_t kv_size() const { return s.B * s.Tk * s.kv_stride; }
  int64_t out_size() const { return s.B * s.Tq * s.Hq * s.D; }
  int64_t lse_size() const { return s.B * s.Hq * s.Tq; }
};
BlockData block_data(const BlockDims& bd, const BlockCase& c, uint64_t seed) {
  BlockData d;
  d.s = BlockShape{bd.B,
                   int64_t(c.qp.size()),
                   int64_t(c.kp.size()),
                   bd.Hq,
                   bd.Hkv,
                   bd.D,
                   bd.Hq * bd.D + 8,
                   2 * bd.Hkv * bd.D,
                   1.0f / std::sqrt(float(bd.D))};
  d.q = rounded(test::randn(size_t(d.q_size()), seed));
  d.kv = rounded(test::randn(size_t(d.kv_size()), seed + 1));
  d.dout = test::randn(size_t(d.out_size()), seed + 2);
  d.delta = test::randn(size_t(d.lse_size()), seed + 3, 0.5f);
  d.dq0 = test::randn(size_t(d.q_size()), seed + 4);
  d.dkv0 = test::randn(size_t(d.kv_size()), seed + 5);
  return d;
}
// A "final" lse (of the whole ring) from the block's own: larger by a random amount, and on rows
// that see no key of this block alternately -inf and finite (such a row still contributes nothing).
std::vector<float> final_lse(const std::vector<float>& own, uint64_t seed) {
  const auto off = test::randn(own.size(), seed, 0.5f);
  std::vector<float> l(own.size());
  for (size_t i = 0; i < own.size(); ++i)
    l[i] = own[i] == -kInf ? (i % 2 ? 1.5f : -kInf) : own[i] + std::abs(off[i]);
  return l;
}

// The dq (q's columns) and dk, dv of gradient buffers laid out as q and kv.
Grads block_grads(const BlockShape& s, const std::vector<float>& gq,
                  const std::vector<float>& gkv) {
  return {columns(gq, s.B * s.Tq, s.q_stride, 0, s.Hq * s.D),
          columns(gkv, s.B * s.Tk, s.kv_stride, 0, s.Hkv * s.D),
          columns(gkv, s.B * s.Tk, s.kv_stride, s.Hkv * s.D, s.Hkv * s.D)};
}

// Device copies of a block's inputs.
struct BlockDev {
  Tensor q, kv, qp, kp, dout, lse, delta;
  BlockDev(const BlockData& d, const BlockCase& c, DType dt)
      : q(test::to_device(d.q, dt)),
        kv(test::to_device(d.kv, dt)),
        qp(positions_device(c.qp)),
        kp(positions_device(c.kp)),
        dout(test::to_device(d.dout)),
        lse(test::to_device(d.lse)),
        delta(test::to_device(d.delta)) {}
};

TEST_F(AttentionCuda, BlockForwardMatchesCpu) {
  uint64_t seed = 400;
  for (const BlockDims& bd : kBlockDims)
    for (const BlockCase& c : block_cases()) {
      SCOPED_TRACE(c.name + " D=" + std::to_string(bd.D) + " Hq=" + std::to_string(bd.Hq) +
                   " Hkv=" + std::to_string(bd.Hkv));
      BlockData d = block_data(bd, c, seed += 10);
      const BlockShape& s = d.s;
      const int64_t HD = s.Hkv * s.D;
      std::vector<float> out(size_t(d.out_size())), lse(size_t(d.lse_size()));
      cpu::attention_block_forward(s, d.q.data(), d.kv.data(), d.kv.data() + HD, c.qp.data(),
                                   c.kp.data(), out.data(), lse.data());
      const auto q16 = to_bf16(d.q), kv16 = to_bf16(d.kv);
      std::vector<float> out_b(out.size()), lse_b(lse.size());
      cpu::attention_block_forward_bf16(s, q16.data(), kv16.data(), kv16.data() + HD, c.qp.data(),
                                        c.kp.data(), out_b.data(), lse_b.data());
      for (const DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string(dtype_name(dt)));
        const BlockDev x(d, c, dt);
        const Tensor o = test::nan_device(d.out_size()), l = test::nan_device(d.lse_size());
        if (dt == DType::f32) {
          const float* kv = x.kv.data<float>();
          cuda::attention_block_forward(s, x.q.data<float>(), kv, kv + HD, pos_of(x.qp),
                                        pos_of(x.kp), o.data<float>(), l.data<float>());
        } else {
          const bf16* kv = x.kv.data<bf16>();
          cuda::attention_block_forward_bf16(s, x.q.data<bf16>(), kv, kv + HD, pos_of(x.qp),
                                             pos_of(x.kp), o.data<float>(), l.data<float>());
        }
        const auto got = test::to_host(o), got_lse = test::to_host(l);
        const auto& want = dt == DType::f32 ? out : out_b;
        const auto& want_lse = dt == DType::f32 ? lse : lse_b;
        EXPECT_LE(test::rel_l2(got, want), dt == DType::f32 ? kTol : kFwdTol) << "out";
        if (dt == DType::bf16) {
          EXPECT_LE(test::rel_l2(got, out), kFwdTol) << "out against f32";
        }
        expect_lse_near(got_lse, want_lse, dt == DType::f32 ? kTol : kLseTol, "block");
        // Rows that see no key: out exactly 0 (attention_merge relies on it).
        int64_t empty = 0;
        for (int64_t b = 0; b < s.B; ++b)
          for (int64_t h = 0; h < s.Hq; ++h)
            for (int64_t t = 0; t < s.Tq; ++t)
              if (want_lse[size_t((b * s.Hq + h) * s.Tq + t)] == -kInf) {
                ++empty;
                for (int64_t e = 0; e < s.D; ++e)
                  ASSERT_EQ(got[size_t(((b * s.Tq + t) * s.Hq + h) * s.D + e)], 0.0f);
              }
        if (c.name.rfind("some rows empty", 0) == 0) {
          EXPECT_GT(empty, 0);
          EXPECT_LT(empty, d.lse_size());
        }
        if (c.name.rfind("fully masked", 0) == 0) {
          EXPECT_EQ(empty, d.lse_size());
        }
      }
    }
}

// The block backward from a final lse and delta: overwriting (s.accumulate false; NaN-filled
// gradients) against the CPU's, then accumulating onto random gradients: the overwriting result
// added (a fully masked pair leaves them bit for bit).
TEST_F(AttentionCuda, BlockBackwardMatchesCpu) {
  uint64_t seed = 600;
  for (const BlockDims& bd : kBlockDims)
    for (const BlockCase& c : block_cases()) {
      SCOPED_TRACE(c.name + " D=" + std::to_string(bd.D) + " Hq=" + std::to_string(bd.Hq) +
                   " Hkv=" + std::to_string(bd.Hkv));
      BlockData d = block_data(bd, c, seed += 10);
      BlockShape s = d.s;
      const int64_t HD = s.Hkv * s.D;
      const auto q16 = to_bf16(d.q), kv16 = to_bf16(d.kv);
      for (const DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string(dtype_name(dt)));
        // The block's own forward (of this dtype) gives the lse the final one is made from.
        std::vector<float> out(size_t(d.out_size())), own(size_t(d.lse_size()));
        if (dt == DType::f32)
          cpu::attention_block_forward(s, d.q.data(), d.kv.data(), d.kv.data() + HD, c.qp.data(),
                                       c.kp.data(), out.data(), own.data());
        else
          cpu::attention_block_forward_bf16(s, q16.data(), kv16.data(), kv16.data() + HD,
                                            c.qp.data(), c.kp.data(), out.data(), own.data());
        d.lse = final_lse(own, seed + 7);
        const auto cpu_backward = [&](bool accumulate, std::vector<float>& gq,
                                      std::vector<float>& gkv) {
          s.accumulate = accumulate;
          if (dt == DType::f32)
            cpu::attention_block_backward(s, d.q.data(), d.kv.data(), d.kv.data() + HD, c.qp.data(),
                                          c.kp.data(), d.lse.data(), d.delta.data(), d.dout.data(),
                                          gq.data(), gkv.data(), gkv.data() + HD);
          else
            cpu::attention_block_backward_bf16(s, q16.data(), kv16.data(), kv16.data() + HD,
                                               c.qp.data(), c.kp.data(), d.lse.data(),
                                               d.delta.data(), d.dout.data(), gq.data(), gkv.data(),
                                               gkv.data() + HD);
        };
        const BlockDev x(d, c, dt);
        const auto gpu_backward = [&](bool accumulate, const Tensor& gq, const Tensor& gkv) {
          s.accumulate = accumulate;
          float* dq = gq.data<float>();
          float* dkv = gkv.data<float>();
          if (dt == DType::f32) {
            const float* kv = x.kv.data<float>();
            cuda::attention_block_backward(s, x.q.data<float>(), kv, kv + HD, pos_of(x.qp),
                                           pos_of(x.kp), x.lse.data<float>(), x.delta.data<float>(),
                                           x.dout.data<float>(), dq, dkv, dkv + HD);
          } else {
            const bf16* kv = x.kv.data<bf16>();
            cuda::attention_block_backward_bf16(
                s, x.q.data<bf16>(), kv, kv + HD, pos_of(x.qp), pos_of(x.kp), x.lse.data<float>(),
                x.delta.data<float>(), x.dout.data<float>(), dq, dkv, dkv + HD);
          }
        };
        // Overwriting. The q buffer's gap columns are not gradients: NaN there is fine.
        std::vector<float> gq(d.q.size(), 7.0f), gkv(d.kv.size(), 7.0f);
        cpu_backward(false, gq, gkv);
        const Tensor tq = test::nan_device(d.q_size()), tkv = test::nan_device(d.kv_size());
        gpu_backward(false, tq, tkv);
        const std::vector<float> over_q = test::to_host(tq), over_kv = test::to_host(tkv);
        const Grads got = block_grads(s, over_q, over_kv), want = block_grads(s, gq, gkv);
        const bool f32 = dt == DType::f32;
        EXPECT_LE(test::rel_l2(got.dq, want.dq), f32 ? kTol : kDqkTol) << "dq";
        EXPECT_LE(test::rel_l2(got.dk, want.dk), f32 ? kTol : kDqkTol) << "dk";
        EXPECT_LE(test::rel_l2(got.dv, want.dv), f32 ? kTol : kDvTol) << "dv";
        // Accumulating onto random values.
        const Tensor aq = test::to_device(d.dq0), akv = test::to_device(d.dkv0);
        gpu_backward(true, aq, akv);
        const std::vector<float> acc_q = test::to_host(aq), acc_kv = test::to_host(akv);
        if (c.name.rfind("fully masked", 0) == 0) {
          EXPECT_EQ(acc_q, d.dq0) << "a fully masked pair changed dq";
          EXPECT_EQ(acc_kv, d.dkv0) << "a fully masked pair changed dk or dv";
          continue;
        }
        std::vector<float> sum_q(d.dq0.size()), sum_kv(d.dkv0.size());
        for (size_t i = 0; i < sum_q.size(); ++i) sum_q[i] = d.dq0[i] + over_q[i];
        for (size_t i = 0; i < sum_kv.size(); ++i) sum_kv[i] = d.dkv0[i] + over_kv[i];
        const Grads acc = block_grads(s, acc_q, acc_kv), sum = block_grads(s, sum_q, sum_kv);
        EXPECT_LE(test::rel_l2(acc.dq, sum.dq), 1e-6) << "dq not added";
        EXPECT_LE(test::rel_l2(acc.dk, sum.dk), 1e-6) << "dk not added";
        EXPECT_LE(test::rel_l2(acc.dv, sum.dv), 1e-6) << "dv not added";
        // And the CPU's accumulating result.
        std::vector<float> cq = d.dq0, ckv = d.dkv0;
        cpu_backward(true, cq, ckv);
        const Grads cacc = block_grads(s, cq, ckv);
        EXPECT_LE(test::rel_l2(acc.dq, cacc.dq), f32 ? kTol : kDqkTol) << "accumulated dq";
        EXPECT_LE(test::rel_l2(acc.dk, cacc.dk), f32 ? kTol : kDqkTol) << "accumulated dk";
        EXPECT_LE(test::rel_l2(acc.dv, cacc.dv), f32 ? kTol : kDvTol) << "accumulated dv";
      }
    }
}

// ---- merge and delta ---------------------------------------------------------------------------

// Rows where a, b or both are empty (-inf), and rows where both hold a partial result.
TEST_F(AttentionCuda, MergeMatchesCpu) {
  const int64_t B = 2, Tq = 33, Hq = 4, D = 64;
  const int64_t n_out = B * Tq * Hq * D, n_lse = B * Hq * Tq;
  auto out_a = test::randn(size_t(n_out), 1), out_b = test::randn(size_t(n_out), 2);
  auto lse_a = test::randn(size_t(n_lse), 3, 2.0f), lse_b = test::randn(size_t(n_lse), 4, 2.0f);
  for (int64_t i = 0; i < n_lse; ++i) {
    if (i % 5 == 1 || i % 7 == 0) lse_a[size_t(i)] = -kInf;
    if (i % 5 == 2 || i % 7 == 0) lse_b[size_t(i)] = -kInf;
  }
  // An empty row's out is 0, as the block forward writes it.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const size_t li = size_t((b * Hq + h) * Tq + t), at = size_t(((b * Tq + t) * Hq + h) * D);
        if (lse_a[li] == -kInf) std::fill_n(out_a.begin() + at, D, 0.0f);
        if (lse_b[li] == -kInf) std::fill_n(out_b.begin() + at, D, 0.0f);
      }
  const Tensor oa = test::to_device(out_a), la = test::to_device(lse_a),
               ob = test::to_device(out_b), lb = test::to_device(lse_b);
  cpu::attention_merge(B, Tq, Hq, D, out_a.data(), lse_a.data(), out_b.data(), lse_b.data());
  cuda::attention_merge(B, Tq, Hq, D, oa.data<float>(), la.data<float>(), ob.data<float>(),
                        lb.data<float>());
  EXPECT_LE(test::rel_l2(test::to_host(oa), out_a), kTol);
  expect_lse_near(test::to_host(la), lse_a, kTol, "merge");
}

TEST_F(AttentionCuda, DeltaMatchesCpu) {
  for (const Dims& d : {Dims{2, 65, 4, 2, 64}, Dims{1, 7, 32, 8, 128}, Dims{2, 33, 4, 4, 40}}) {
    SCOPED_TRACE(name(d));
    const size_t n = size_t(d.rows() * d.Hq * d.D), n_lse = size_t(d.B * d.Hq * d.T);
    const auto out = test::randn(n, 11), dout = test::randn(n, 12);
    std::vector<float> want(n_lse), want16(n_lse);
    cpu::attention_delta(d.B, d.T, d.Hq, d.D, out.data(), dout.data(), want.data());
    const auto out16 = to_bf16(out);
    cpu::attention_delta_bf16(d.B, d.T, d.Hq, d.D, out16.data(), dout.data(), want16.data());
    const Tensor o = test::to_device(out), o16 = test::to_device(out, DType::bf16),
                 g = test::to_device(dout), r = test::nan_device(int64_t(n_lse)),
                 r16 = test::nan_device(int64_t(n_lse));
    cuda::attention_delta(d.B, d.T, d.Hq, d.D, o.data<float>(), g.data<float>(), r.data<float>());
    cuda::attention_delta_bf16(d.B, d.T, d.Hq, d.D, o16.data<bf16>(), g.data<float>(),
                               r16.data<float>());
    EXPECT_LE(test::rel_l2(test::to_host(r), want), kTol) << "f32";
    EXPECT_LE(test::rel_l2(test::to_host(r16), want16), kTol) << "bf16";
  }
}

// The arguments are checked on the host before anything touches the device (no GPU needed): bad
// shapes with null pointers name the shape, good shapes with null pointers name the pointers.
TEST(AttentionCudaHost, BadArgumentsThrowBeforeTheDevice) {
  AttentionShape s{1, 4, 4, 2, 8, 64, 32, 0.35f};
  AttentionShape bad = s;
  bad.Hkv = 3;
  test::expect_error(
      [&] { cuda::attention_forward(bad, nullptr, nullptr, nullptr, nullptr, nullptr); },
      {"attention_forward", "multiple of Hkv"});
  bad = s;
  bad.q_stride = 31;
  test::expect_error(
      [&] {
        cuda::attention_backward(bad, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, nullptr);
      },
      {"attention_backward", "q_stride"});
  bad = s;
  bad.scale = 0.0f;
  test::expect_error(
      [&] {
        cuda::attention_forward_bf16(bad, nullptr, nullptr, nullptr, static_cast<bf16*>(nullptr),
                                     nullptr);
      },
      {"attention_forward_bf16", "scale"});
  bad = s;
  bad.T = 0;
  test::expect_error(
      [&] {
        cuda::attention_backward_bf16(bad, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, nullptr, nullptr);
      },
      {"attention_backward_bf16", "positive"});
  test::expect_error(
      [&] { cuda::attention_forward(s, nullptr, nullptr, nullptr, nullptr, nullptr); },
      {"attention_forward", "null pointer"});
  BlockShape b{1, 4, 5, 4, 2, 8, 32, 32, 0.35f};
  BlockShape bb = b;
  bb.kv_stride = 15;
  test::expect_error(
      [&] {
        cuda::attention_block_forward(bb, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      nullptr);
      },
      {"attention_block_forward", "kv_stride"});
  test::expect_error(
      [&] {
        cuda::attention_block_backward(b, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                       nullptr, nullptr, nullptr, nullptr, nullptr);
      },
      {"attention_block_backward", "null pointer"});
  test::expect_error(
      [&] {
        cuda::attention_block_backward_bf16(b, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                            nullptr, nullptr, nullptr, nullptr, nullptr);
      },
      {"attention_block_backward_bf16", "null pointer"});
  test::expect_error([&] { cuda::attention_merge(1, 0, 4, 8, nullptr, nullptr, nullptr, nullptr); },
                     {"attention_merge", "positive"});
  test::expect_error([&] { cuda::attention_delta(1, 4, 4, 8, nullptr, nullptr, nullptr); },
                     {"attention_delta", "null pointer"});
}

}  // namespace
