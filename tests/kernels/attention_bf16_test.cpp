// The bf16 attention kernels (kernels/cpu/attention_bf16.hpp) against a naive fp64 attention on
// the same bf16-rounded inputs, against fp64 finite differences, against the f32 kernels, across
// thread counts and schemes, and on every tier (with vdpbf16ps and with its emulation).
#include "kernels/cpu/attention_bf16.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::cpu::AttentionShape;
using loom::cpu::BlockShape;

namespace {

struct Dims {
  int64_t B, T, Hq, Hkv, D;
};
std::string name(const Dims& d) {
  return "B=" + std::to_string(d.B) + " T=" + std::to_string(d.T) + " Hq=" + std::to_string(d.Hq) +
         " Hkv=" + std::to_string(d.Hkv) + " D=" + std::to_string(d.D);
}

// fp64 causal attention of dense q [B][T][Hq][D], k/v [B][T][Hkv][D] with positions pos[t] (the
// same for q and k): out like q, lse [B][Hq][T]; and the analytic gradient of sum(out * dout).
struct Ref {
  std::vector<double> out, lse, dq, dk, dv;
};
Ref naive(const Dims& d, const std::vector<double>& q, const std::vector<double>& k,
          const std::vector<double>& v, const std::vector<double>& dout, double scale) {
  const int64_t G = d.Hq / d.Hkv, T = d.T, D = d.D;
  Ref r;
  r.out.assign(q.size(), 0.0);
  r.lse.assign(size_t(d.B * d.Hq * T), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  std::vector<double> s(T), p(T), dp(T);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t qo = ((b * T + i) * d.Hq + h) * D;
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t ko = ((b * T + j) * d.Hkv + h / G) * D;
          double acc = 0, accp = 0;
          for (int64_t e = 0; e < D; ++e) {
            acc += q[qo + e] * k[ko + e];
            accp += dout[qo + e] * v[ko + e];
          }
          s[j] = acc * scale;
          dp[j] = accp;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
        r.lse[(b * d.Hq + h) * T + i] = m + std::log(sum);
        double di = 0;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(s[j] - m) / sum;
          di += p[j] * dp[j];
          const int64_t ko = ((b * T + j) * d.Hkv + h / G) * D;
          for (int64_t e = 0; e < D; ++e) r.out[qo + e] += p[j] * v[ko + e];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t ko = ((b * T + j) * d.Hkv + h / G) * D;
          const double ds = p[j] * (dp[j] - di) * scale;
          for (int64_t e = 0; e < D; ++e) {
            r.dq[qo + e] += ds * k[ko + e];
            r.dk[ko + e] += ds * q[qo + e];
            r.dv[ko + e] += p[j] * dout[qo + e];
          }
        }
      }
  return r;
}

std::vector<bf16> round_all(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(x[i]);
  return y;
}
std::vector<float> widen_all(const std::vector<bf16>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_float(x[i]);
  return y;
}

// Random inputs (never zeros), rounded to bf16; dout rounded too, so that the kernel's rounding of
// it is exact and the reference sees the same values.
struct Case {
  Dims d;
  std::vector<bf16> q, k, v;
  std::vector<float> dout;
  float scale;
  Case(const Dims& dims, uint64_t seed, float input_scale = 1.0f) : d(dims) {
    q = round_all(test::randn(size_t(d.B * d.T * d.Hq * d.D), seed, input_scale));
    k = round_all(test::randn(size_t(d.B * d.T * d.Hkv * d.D), seed + 1, input_scale));
    v = round_all(test::randn(size_t(d.B * d.T * d.Hkv * d.D), seed + 2));
    dout = widen_all(round_all(test::randn(size_t(d.B * d.T * d.Hq * d.D), seed + 3)));
    scale = 1.0f / std::sqrt(float(d.D));
  }
  Ref ref() const {
    const auto dbl = [](const std::vector<bf16>& x) {
      const std::vector<float> f = widen_all(x);
      return std::vector<double>(f.begin(), f.end());
    };
    return naive(d, dbl(q), dbl(k), dbl(v), std::vector<double>(dout.begin(), dout.end()), scale);
  }
};

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// Runs the kernels on q/k/v inside one fused token-major buffer with gaps (as the model's qkv);
// dq/dk/dv in a fused buffer of the same layout whose gaps must keep their sentinel.
Result run_bf16(const Case& c, bool backward = true) {
  const Dims& d = c.d;
  const int64_t rows = d.B * d.T, koff = d.Hq * d.D + 3, voff = koff + d.Hkv * d.D + 5;
  const int64_t stride = voff + d.Hkv * d.D + 2;
  std::vector<bf16> buf(size_t(rows * stride), float_to_bf16(7.0f));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(&c.q[r * d.Hq * d.D], d.Hq * d.D, &buf[r * stride]);
    std::copy_n(&c.k[r * d.Hkv * d.D], d.Hkv * d.D, &buf[r * stride + koff]);
    std::copy_n(&c.v[r * d.Hkv * d.D], d.Hkv * d.D, &buf[r * stride + voff]);
  }
  const AttentionShape s{d.B, d.T, d.Hq, d.Hkv, d.D, stride, stride, c.scale};
  Result r;
  r.out.assign(c.dout.size(), NAN);
  r.lse.assign(size_t(d.B * d.Hq * d.T), NAN);
  cpu::attention_forward_bf16(s, buf.data(), buf.data() + koff, buf.data() + voff, r.out.data(),
                              r.lse.data());
  // The variant that writes the output rounded: the bits of the f32 output cast, the same lse.
  std::vector<bf16> out_rounded(c.dout.size(), float_to_bf16(7.0f));
  std::vector<float> lse_rounded(r.lse.size(), NAN);
  cpu::attention_forward_bf16(s, buf.data(), buf.data() + koff, buf.data() + voff,
                              out_rounded.data(), lse_rounded.data());
  const std::vector<bf16> cast = round_all(r.out);
  EXPECT_EQ(std::memcmp(out_rounded.data(), cast.data(), cast.size() * sizeof(bf16)), 0);
  EXPECT_EQ(lse_rounded, r.lse);
  if (!backward) return r;
  constexpr float kSentinel = 12345.0f;
  std::vector<float> grad(size_t(rows * stride), kSentinel);
  const std::vector<bf16> out16 = round_all(r.out);
  cpu::attention_backward_bf16(s, buf.data(), buf.data() + koff, buf.data() + voff, out16.data(),
                               r.lse.data(), c.dout.data(), grad.data(), grad.data() + koff,
                               grad.data() + voff);
  int64_t left = 0;
  for (float x : grad) left += x == kSentinel;
  EXPECT_EQ(left, rows * (stride - d.Hq * d.D - 2 * d.Hkv * d.D))
      << "backward wrote outside dq/dk/dv or skipped some";
  for (int64_t row = 0; row < rows; ++row) {
    r.dq.insert(r.dq.end(), &grad[row * stride], &grad[row * stride] + d.Hq * d.D);
    r.dk.insert(r.dk.end(), &grad[row * stride + koff], &grad[row * stride + koff] + d.Hkv * d.D);
    r.dv.insert(r.dv.end(), &grad[row * stride + voff], &grad[row * stride + voff] + d.Hkv * d.D);
  }
  return r;
}

// Runs body once per tier, and on a tier with vdpbf16ps once more with it emulated.
template <class Body>
void for_each_variant(Body&& body) {
  test::for_each_isa([&](cpu::Isa) {
    const bool native = cpu::attention_bf16_native();
    {
      SCOPED_TRACE(native ? "vdpbf16ps" : "emulated");
      body();
    }
    if (native) {
      SCOPED_TRACE("emulated on a vdpbf16ps tier");
      const test::ScopedBf16Native emulated(false);
      body();
    }
  });
}

// Tolerances. The products are exact in f32 (bf16 x bf16) and accumulate in f32, so what departs
// from fp64 is the bf16 rounding of P (forward, dV) and of dS (dK, dQ), and in the backward of the
// attention output that Di reads: a relative error of at most 2^-8 (3.9e-3) per element, about
// 1.5e-3 on average, independent across elements. A sum of such terms with random signs (the
// values of V, dO, Q, K) keeps that relative size, so out and dv land near 1.5e-3 and the bound
// 6e-3 leaves headroom; dS = P (dP - Di) loses some digits to the cancellation of dP - Di, so dq
// and dk get 1.5e-2. A real defect (a wrong mask, a dropped tile or GQA term, a missed rescale, an
// operand of the wrong pair) gives errors of 0.1 and more. lse is computed from unrounded f32
// probabilities: f32 accuracy (scores of std ~input_scale^2). Measured on the shapes below (every
// tier, input scales 1 and 2.5): out 0.4-1.1e-3, dv 1.2-1.7e-3, dq and dk 1.8-4.9e-3.
constexpr double kFwdTol = 4e-3;
constexpr double kLseTol = 1e-5;
constexpr double kDvTol = 5e-3;
constexpr double kDqkTol = 1.5e-2;

const std::vector<Dims> kShapes = {
    {2, 130, 4, 2, 64},  // GQA 2, T past two tiles
    {1, 200, 2, 1, 48},  // bench-tiny's head dim
    {1, 70, 4, 4, 64},   // bench-small's
    {1, 90, 2, 1, 128},  // Llama 8B's
    {2, 37, 2, 2, 37},   // an odd head dim, one partial tile
    {1, 64, 2, 1, 20},   // a head dim below one vector of pairs
    {1, 1, 2, 1, 64},
};

void expect_close(const Result& r, const Ref& g, const Dims& d, bool backward) {
  EXPECT_LT(test::rel_l2(r.out, g.out), kFwdTol) << name(d) << " out";
  double lse_err = 0;
  for (size_t i = 0; i < g.lse.size(); ++i)
    lse_err = std::max(lse_err,
                       std::abs(double(r.lse[i]) - g.lse[i]) / std::max(1.0, std::abs(g.lse[i])));
  EXPECT_LT(lse_err, kLseTol) << name(d) << " lse";
  if (!backward) return;
  if (d.T == 1) {  // one key per query: P = 1, dS = 0
    EXPECT_LT(test::max_abs_diff(r.dq, g.dq), 1e-6) << name(d) << " dq";
    EXPECT_LT(test::max_abs_diff(r.dk, g.dk), 1e-6) << name(d) << " dk";
  } else {
    EXPECT_LT(test::rel_l2(r.dq, g.dq), kDqkTol) << name(d) << " dq";
    EXPECT_LT(test::rel_l2(r.dk, g.dk), kDqkTol) << name(d) << " dk";
  }
  EXPECT_LT(test::rel_l2(r.dv, g.dv), kDvTol) << name(d) << " dv";
}

TEST(AttentionBf16, ForwardAndBackwardMatchNaiveFp64) {
  for (const Dims& d : kShapes)
    for (float input_scale : {1.0f, 2.5f}) {  // 2.5: scores of std ~6 stress the online rescale
      Case c(d, 100 + d.T + d.D, input_scale);
      const Ref g = c.ref();
      for_each_variant([&] {
        SCOPED_TRACE("input_scale " + std::to_string(input_scale));
        expect_close(run_bf16(c), g, d, true);
      });
    }
}

// The kernel's gradient against fp64 central differences of the naive attention (on the bf16
// inputs, whose values the differences perturb in fp64), sampled coordinates spanning tiles.
TEST(AttentionBf16, BackwardMatchesFiniteDifferences) {
  for (const Dims& d : {Dims{1, 70, 2, 1, 48}, Dims{1, 67, 4, 2, 64}}) {
    Case c(d, 300 + d.T);
    const auto dbl = [](const std::vector<bf16>& x) {
      const std::vector<float> f = widen_all(x);
      return std::vector<double>(f.begin(), f.end());
    };
    const std::vector<double> r(c.dout.begin(), c.dout.end());
    std::vector<double> x[3] = {dbl(c.q), dbl(c.k), dbl(c.v)};
    const auto loss = [&] {
      const Ref f = naive(d, x[0], x[1], x[2], r, c.scale);
      double L = 0;
      for (size_t i = 0; i < f.out.size(); ++i) L += f.out[i] * r[i];
      return L;
    };
    std::vector<int64_t> idx[3];
    std::vector<double> num[3];
    for (int which = 0; which < 3; ++which) {
      std::mt19937_64 rng(which + 11);
      for (int s = 0; s < 60; ++s) {
        const int64_t i = int64_t(rng() % x[which].size());
        idx[which].push_back(i);
        const double v0 = x[which][i], h = 1e-5;
        x[which][i] = v0 + h;
        const double fp = loss();
        x[which][i] = v0 - h;
        const double fm = loss();
        x[which][i] = v0;
        num[which].push_back((fp - fm) / (2 * h));
      }
    }
    for_each_variant([&] {
      const Result res = run_bf16(c);
      for (int which = 0; which < 3; ++which) {
        const auto& kern = which == 0 ? res.dq : which == 1 ? res.dk : res.dv;
        std::vector<double> got;
        for (int64_t i : idx[which]) got.push_back(kern[i]);
        EXPECT_LT(test::rel_l2(got, num[which]), which == 2 ? kDvTol : kDqkTol)
            << name(d) << " input " << which;
      }
    });
  }
}

// Every tier (and vdpbf16ps against its emulation) computes the same function: bf16 products, P
// and dS rounded, f32 sums. They differ only in summation order and in the last bits of exp (and
// so in the rare rounding of a P or dS that falls the other way: measured up to 5e-5 on dv), where
// the bf16 rounding itself is 1e-3: a tier that skipped a rounding, or rounded something else,
// fails by that.
TEST(AttentionBf16, EveryTierComputesTheSameFunction) {
  for (const Dims& d : {Dims{2, 130, 4, 2, 64}, Dims{1, 90, 2, 1, 128}, Dims{1, 100, 2, 1, 48}}) {
    Case c(d, 800 + d.T);
    std::vector<Result> all;
    for_each_variant([&] { all.push_back(run_bf16(c)); });
    for (size_t i = 1; i < all.size(); ++i) {
      EXPECT_LT(test::rel_l2(all[i].out, all[0].out), 2e-4) << name(d) << " variant " << i;
      EXPECT_LT(test::rel_l2(all[i].dq, all[0].dq), 2e-4) << name(d) << " variant " << i;
      EXPECT_LT(test::rel_l2(all[i].dk, all[0].dk), 2e-4) << name(d) << " variant " << i;
      EXPECT_LT(test::rel_l2(all[i].dv, all[0].dv), 2e-4) << name(d) << " variant " << i;
    }
  }
}

// The bf16 kernels agree with the f32 kernels on the same (rounded) inputs within the bf16
// tolerances: the f32 kernels compute the same function without rounding P and dS.
TEST(AttentionBf16, AgreesWithF32Kernels) {
  for (const Dims& d : {Dims{2, 130, 4, 2, 64}, Dims{1, 150, 2, 1, 128}, Dims{1, 100, 2, 2, 48}}) {
    Case c(d, 600 + d.T);
    const std::vector<float> q = widen_all(c.q), k = widen_all(c.k), v = widen_all(c.v);
    const AttentionShape s{d.B, d.T, d.Hq, d.Hkv, d.D, d.Hq * d.D, d.Hkv * d.D, c.scale};
    Result f;
    f.out.resize(q.size());
    f.lse.resize(size_t(d.B * d.Hq * d.T));
    f.dq.resize(q.size());
    f.dk.resize(k.size());
    f.dv.resize(v.size());
    cpu::attention_forward(s, q.data(), k.data(), v.data(), f.out.data(), f.lse.data());
    const std::vector<float> out_r = widen_all(round_all(f.out));  // what the bf16 path saves
    cpu::attention_backward(s, q.data(), k.data(), v.data(), out_r.data(), f.lse.data(),
                            c.dout.data(), f.dq.data(), f.dk.data(), f.dv.data());
    for_each_variant([&] {
      const Result r = run_bf16(c);
      EXPECT_LT(test::rel_l2(r.out, f.out), kFwdTol) << name(d);
      EXPECT_LT(test::max_abs_diff(r.lse, f.lse), kLseTol * 10) << name(d);
      EXPECT_LT(test::rel_l2(r.dq, f.dq), kDqkTol) << name(d);
      EXPECT_LT(test::rel_l2(r.dk, f.dk), kDqkTol) << name(d);
      EXPECT_LT(test::rel_l2(r.dv, f.dv), kDvTol) << name(d);
    });
  }
}

// Bit-identical for 1 and 2 threads; B*Hkv = 1 makes 2 threads take the split scheme, 1 thread
// the fused one, so the schemes are compared too.
TEST(AttentionBf16, DeterministicAcrossThreadCountsAndSchemes) {
  const int saved = omp_get_max_threads();
  for (const Dims& d : {Dims{1, 200, 4, 1, 64}, Dims{2, 130, 4, 2, 48}, Dims{1, 70, 2, 1, 37}}) {
    Case c(d, 500 + d.T);
    for_each_variant([&] {
      omp_set_num_threads(1);
      const Result one = run_bf16(c);
      omp_set_num_threads(2);
      const Result two = run_bf16(c);
      omp_set_num_threads(saved);
      EXPECT_EQ(one.out, two.out) << name(d);
      EXPECT_EQ(one.lse, two.lse) << name(d);
      EXPECT_EQ(one.dq, two.dq) << name(d);
      EXPECT_EQ(one.dk, two.dk) << name(d);
      EXPECT_EQ(one.dv, two.dv) << name(d);
    });
  }
}

// The block kernels with positions in the zigzag order of context parallelism (tiles straddling
// two chunks take the entry-by-entry mask): the same attention as the causal kernel, rows
// permuted.
TEST(AttentionBf16, BlockKernelsWithZigzagPositions) {
  const Dims d{1, 160, 2, 1, 64};
  Case c(d, 700);
  const Ref g = c.ref();
  // Chunks of 40 in the order 0, 3, 1, 2 (cp 2's rank 0 then rank 1), one block of all tokens.
  std::vector<int64_t> pos;
  for (int64_t ch : {0, 3, 1, 2})
    for (int64_t t = 0; t < 40; ++t) pos.push_back(ch * 40 + t);
  const int64_t T = d.T, qw = d.Hq * d.D, kw = d.Hkv * d.D;
  std::vector<bf16> q(c.q.size()), k(c.k.size()), v(c.v.size());
  std::vector<float> dout(c.dout.size());
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(&c.q[pos[t] * qw], qw, &q[t * qw]);
    std::copy_n(&c.k[pos[t] * kw], kw, &k[t * kw]);
    std::copy_n(&c.v[pos[t] * kw], kw, &v[t * kw]);
    std::copy_n(&c.dout[pos[t] * qw], qw, &dout[t * qw]);
  }
  for_each_variant([&] {
    BlockShape s{d.B, T, T, d.Hq, d.Hkv, d.D, qw, kw, c.scale};
    std::vector<float> out(q.size()), lse(size_t(d.Hq * T));
    cpu::attention_block_forward_bf16(s, q.data(), k.data(), v.data(), pos.data(), pos.data(),
                                      out.data(), lse.data());
    std::vector<float> delta(lse.size()), dq(q.size(), 0.0f), dk(k.size(), 0.0f),
        dv(v.size(), 0.0f);
    const std::vector<bf16> out16 = round_all(out);
    cpu::attention_delta_bf16(d.B, T, d.Hq, d.D, out16.data(), dout.data(), delta.data());
    cpu::attention_block_backward_bf16(s, q.data(), k.data(), v.data(), pos.data(), pos.data(),
                                       lse.data(), delta.data(), dout.data(), dq.data(), dk.data(),
                                       dv.data());
    Result r;  // back in causal order
    r.out.resize(out.size());
    r.lse.resize(lse.size());
    r.dq.resize(dq.size());
    r.dk.resize(dk.size());
    r.dv.resize(dv.size());
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(&out[t * qw], qw, &r.out[pos[t] * qw]);
      std::copy_n(&dq[t * qw], qw, &r.dq[pos[t] * qw]);
      std::copy_n(&dk[t * kw], kw, &r.dk[pos[t] * kw]);
      std::copy_n(&dv[t * kw], kw, &r.dv[pos[t] * kw]);
      for (int64_t h = 0; h < d.Hq; ++h) r.lse[h * T + pos[t]] = lse[h * T + t];
    }
    expect_close(r, g, d, true);
  });
}

// Keys at positions shifted past the queries' (a block pair of context parallelism seen from a
// later key chunk): diagonal tile pairs with a nonzero offset of both signs, rows that see no key
// (out 0, lse -inf), and a query tile that sees no key tile, whose dq the overwriting backward
// must zero. Against the f32 block kernels on the same inputs; the overwriting backward (into
// sentinels) equals the accumulating one (into zeros) bit for bit, in both backward schemes.
TEST(AttentionBf16, BlockKernelsWithShiftedKeyPositions) {
  for (const Dims& d : {Dims{1, 150, 2, 1, 48}, Dims{1, 150, 4, 2, 64}}) {
    Case c(d, 900 + d.D);
    const int64_t T = d.T, qw = d.Hq * d.D, kw = d.Hkv * d.D;
    std::vector<int64_t> qpos(static_cast<size_t>(T)), kpos(static_cast<size_t>(T));
    std::iota(qpos.begin(), qpos.end(), int64_t(0));
    std::iota(kpos.begin(), kpos.end(), int64_t(70));
    const BlockShape s{d.B, T, T, d.Hq, d.Hkv, d.D, qw, kw, c.scale};
    const std::vector<float> q = widen_all(c.q), k = widen_all(c.k), v = widen_all(c.v);
    std::vector<float> fout(q.size()), flse(size_t(d.Hq * T)), fdelta(flse.size());
    cpu::attention_block_forward(s, q.data(), k.data(), v.data(), qpos.data(), kpos.data(),
                                 fout.data(), flse.data());
    const std::vector<bf16> fout16 = round_all(fout);
    const std::vector<float> fout_r = widen_all(fout16);
    cpu::attention_delta(d.B, T, d.Hq, d.D, fout_r.data(), c.dout.data(), fdelta.data());
    std::vector<float> fdq(q.size(), 0.0f), fdk(k.size(), 0.0f), fdv(v.size(), 0.0f);
    cpu::attention_block_backward(s, q.data(), k.data(), v.data(), qpos.data(), kpos.data(),
                                  flse.data(), fdelta.data(), c.dout.data(), fdq.data(), fdk.data(),
                                  fdv.data());
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2}) {  // 1: the fused backward scheme, 2: the split one (B*Hkv <= 2)
      omp_set_num_threads(threads);
      SCOPED_TRACE(std::to_string(threads) + " threads");
      for_each_variant([&] {
        std::vector<float> out(q.size()), lse(flse.size());
        cpu::attention_block_forward_bf16(s, c.q.data(), c.k.data(), c.v.data(), qpos.data(),
                                          kpos.data(), out.data(), lse.data());
        EXPECT_LT(test::rel_l2(out, fout), kFwdTol) << name(d);
        for (size_t i = 0; i < lse.size(); ++i) {
          if (std::isinf(flse[i])) {
            EXPECT_EQ(lse[i], flse[i]) << name(d) << " lse " << i;
          } else {
            EXPECT_NEAR(lse[i], flse[i], kLseTol * 10 * std::max(1.0f, std::abs(flse[i])))
                << name(d) << " lse " << i;
          }
        }
        // Both backward passes read the f32 kernels' lse and Di, so that they compare the
        // gradients.
        std::vector<float> dq(q.size(), 0.0f), dk(k.size(), 0.0f), dv(v.size(), 0.0f);
        cpu::attention_block_backward_bf16(s, c.q.data(), c.k.data(), c.v.data(), qpos.data(),
                                           kpos.data(), flse.data(), fdelta.data(), c.dout.data(),
                                           dq.data(), dk.data(), dv.data());
        EXPECT_LT(test::rel_l2(dq, fdq), kDqkTol) << name(d);
        EXPECT_LT(test::rel_l2(dk, fdk), kDqkTol) << name(d);
        EXPECT_LT(test::rel_l2(dv, fdv), kDvTol) << name(d);
        BlockShape so = s;
        so.accumulate = false;
        std::vector<float> oq(q.size(), 12345.0f), ok(k.size(), 12345.0f), ov(v.size(), 12345.0f);
        cpu::attention_block_backward_bf16(so, c.q.data(), c.k.data(), c.v.data(), qpos.data(),
                                           kpos.data(), flse.data(), fdelta.data(), c.dout.data(),
                                           oq.data(), ok.data(), ov.data());
        EXPECT_EQ(oq, dq) << name(d);
        EXPECT_EQ(ok, dk) << name(d);
        EXPECT_EQ(ov, dv) << name(d);
      });
    }
    omp_set_num_threads(saved);
  }
}

TEST(AttentionBf16, RejectsBadShapes) {
  std::vector<bf16> b(4096);
  std::vector<float> f(4096);
  AttentionShape s{1, 4, 6, 4, 8, 48, 32, 0.3f};  // Hq not a multiple of Hkv
  EXPECT_THROW(cpu::attention_forward_bf16(s, b.data(), b.data(), b.data(), f.data(), f.data()),
               Error);
  s = AttentionShape{1, 4, 4, 2, 8, 32, 8, 0.3f};  // kv_stride < Hkv*D
  EXPECT_THROW(cpu::attention_backward_bf16(s, b.data(), b.data(), b.data(), b.data(), f.data(),
                                            f.data(), f.data(), f.data(), f.data()),
               Error);
}

}  // namespace
