#include "kernels/cpu/attention.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::cpu::AttentionShape;

namespace {

struct Dims {
  int64_t B, T, Hq, Hkv, D;
};

// Dense fp64 tensors: q [B][T][Hq][D], k/v [B][T][Hkv][D], out like q, lse [B][Hq][T].
struct Dense {
  std::vector<double> q, k, v;
};

void naive_forward(const Dims& d, const Dense& x, double scale, std::vector<double>& out,
                   std::vector<double>& lse) {
  const int64_t G = d.Hq / d.Hkv;
  out.assign(d.B * d.T * d.Hq * d.D, 0.0);
  lse.assign(d.B * d.Hq * d.T, 0.0);
  std::vector<double> s(d.T);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.T; ++i) {
        const double* qi = &x.q[((b * d.T + i) * d.Hq + h) * d.D];
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const double* kj = &x.k[((b * d.T + j) * d.Hkv + h / G) * d.D];
          double acc = 0;
          for (int64_t e = 0; e < d.D; ++e) acc += qi[e] * kj[e];
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
        const double l = m + std::log(sum);
        lse[(b * d.Hq + h) * d.T + i] = l;
        double* o = &out[((b * d.T + i) * d.Hq + h) * d.D];
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - l);
          const double* vj = &x.v[((b * d.T + j) * d.Hkv + h / G) * d.D];
          for (int64_t e = 0; e < d.D; ++e) o[e] += p * vj[e];
        }
      }
}

// Analytic gradient of L = sum(out * dout) in fp64, straight from the softmax formulas (Di is
// sum_j P_ij dP_ij here, not rowsum(dO * O) as in the kernel).
Dense naive_backward(const Dims& d, const Dense& x, const std::vector<double>& dout, double scale) {
  const int64_t G = d.Hq / d.Hkv;
  Dense g{std::vector<double>(x.q.size()), std::vector<double>(x.k.size()),
          std::vector<double>(x.v.size())};
  std::vector<double> s(d.T), p(d.T), dp(d.T);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.T; ++i) {
        const int64_t qoff = ((b * d.T + i) * d.Hq + h) * d.D;
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t koff = ((b * d.T + j) * d.Hkv + h / G) * d.D;
          double acc = 0, accp = 0;
          for (int64_t e = 0; e < d.D; ++e) {
            acc += x.q[qoff + e] * x.k[koff + e];
            accp += dout[qoff + e] * x.v[koff + e];
          }
          s[j] = acc * scale;
          dp[j] = accp;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
        double di = 0;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(s[j] - m) / sum;
          di += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t koff = ((b * d.T + j) * d.Hkv + h / G) * d.D;
          const double ds = p[j] * (dp[j] - di) * scale;
          for (int64_t e = 0; e < d.D; ++e) {
            g.q[qoff + e] += ds * x.k[koff + e];
            g.k[koff + e] += ds * x.q[qoff + e];
            g.v[koff + e] += p[j] * dout[qoff + e];
          }
        }
      }
  return g;
}

// q/k/v for the kernel, either inside one fused token-major buffer with gaps between the parts
// and at the row end (as a fused qkv GEMM with padding would leave them), or as three
// contiguous tensors. Gradient buffers have the same layout; their gaps hold a sentinel that
// the kernel must leave alone.
struct Layout {
  Dims d;
  bool fused;
  int64_t q_stride, kv_stride, k_off, v_off;
  std::vector<float> qbuf, kbuf, vbuf;  // kbuf/vbuf unused when fused

  Layout(const Dims& dims, bool fused_) : d(dims), fused(fused_) {
    const int64_t rows = d.B * d.T;
    if (fused) {
      k_off = d.Hq * d.D + 3;
      v_off = k_off + d.Hkv * d.D + 5;
      q_stride = kv_stride = v_off + d.Hkv * d.D + 2;
      qbuf.assign(rows * q_stride, kSentinel);
    } else {
      k_off = v_off = 0;
      q_stride = d.Hq * d.D;
      kv_stride = d.Hkv * d.D;
      qbuf.assign(rows * q_stride, kSentinel);
      kbuf.assign(rows * kv_stride, kSentinel);
      vbuf.assign(rows * kv_stride, kSentinel);
    }
  }
  static constexpr float kSentinel = 12345.0f;
  float* q() { return qbuf.data(); }
  float* k() { return fused ? qbuf.data() + k_off : kbuf.data(); }
  float* v() { return fused ? qbuf.data() + v_off : vbuf.data(); }
  AttentionShape shape(float scale) const {
    return AttentionShape{d.B, d.T, d.Hq, d.Hkv, d.D, q_stride, kv_stride, scale};
  }
  // Copies between the strided kernel layout and dense tensors.
  static void put(float* dst, int64_t stride, const std::vector<float>& src, int64_t rows,
                  int64_t width) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * stride, &src[r * width], width * sizeof(float));
  }
  static std::vector<float> get(const float* src, int64_t stride, int64_t rows, int64_t width) {
    std::vector<float> out(rows * width);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(&out[r * width], src + r * stride, width * sizeof(float));
    return out;
  }
  void set(const std::vector<float>& q_, const std::vector<float>& k_,
           const std::vector<float>& v_) {
    put(q(), q_stride, q_, d.B * d.T, d.Hq * d.D);
    put(k(), kv_stride, k_, d.B * d.T, d.Hkv * d.D);
    put(v(), kv_stride, v_, d.B * d.T, d.Hkv * d.D);
  }
  std::vector<float> get_q() { return get(q(), q_stride, d.B * d.T, d.Hq * d.D); }
  std::vector<float> get_k() { return get(k(), kv_stride, d.B * d.T, d.Hkv * d.D); }
  std::vector<float> get_v() { return get(v(), kv_stride, d.B * d.T, d.Hkv * d.D); }
  // Number of sentinel values left in the buffers (the gaps must keep them all).
  int64_t sentinels() const {
    int64_t n = 0;
    for (const auto* buf : {&qbuf, &kbuf, &vbuf})
      for (float x : *buf) n += x == kSentinel;
    return n;
  }
};

struct Case {
  Dims d;
  std::vector<float> q, k, v, dout;
  float scale;
  Case(const Dims& dims, uint64_t seed, float input_scale = 1.0f) : d(dims) {
    q = test::randn(d.B * d.T * d.Hq * d.D, seed, input_scale);
    k = test::randn(d.B * d.T * d.Hkv * d.D, seed + 1, input_scale);
    v = test::randn(d.B * d.T * d.Hkv * d.D, seed + 2);
    dout = test::randn(d.B * d.T * d.Hq * d.D, seed + 3);
    scale = 1.0f / std::sqrt(float(d.D));
  }
  Dense dense() const { return {test::to_double(q), test::to_double(k), test::to_double(v)}; }
};

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// Runs forward and backward through the given layout (inputs in `in`, gradients in `grad`).
Result run_kernel(const Case& c, bool fused, bool backward = true) {
  Layout in(c.d, fused), grad(c.d, fused);
  in.set(c.q, c.k, c.v);
  const AttentionShape s = in.shape(c.scale);
  Result r;
  r.out.assign(c.d.B * c.d.T * c.d.Hq * c.d.D, NAN);
  r.lse.assign(c.d.B * c.d.Hq * c.d.T, NAN);
  cpu::attention_forward(s, in.q(), in.k(), in.v(), r.out.data(), r.lse.data());
  if (!backward) return r;
  const int64_t sentinels = grad.sentinels();
  cpu::attention_backward(s, in.q(), in.k(), in.v(), r.out.data(), r.lse.data(), c.dout.data(),
                          grad.q(), grad.k(), grad.v());
  // Every element of dq/dk/dv is overwritten, and nothing else.
  const int64_t expect_left = sentinels - int64_t(c.q.size() + c.k.size() + c.v.size());
  EXPECT_EQ(grad.sentinels(), expect_left) << "backward wrote outside dq/dk/dv or skipped some";
  r.dq = grad.get_q();
  r.dk = grad.get_k();
  r.dv = grad.get_v();
  return r;
}

std::string name(const Dims& d) {
  return "B=" + std::to_string(d.B) + " T=" + std::to_string(d.T) + " Hq=" + std::to_string(d.Hq) +
         " Hkv=" + std::to_string(d.Hkv) + " D=" + std::to_string(d.D);
}

// Tolerances. The kernel runs in fp32 with fp32 accumulation over D (forward) and over up to T
// keys/queries (backward); its measured relative L2 error against fp64 is a few 1e-7. The bounds
// below leave ~10x headroom and are still far below what a real defect produces (a wrong mask,
// a dropped tile, a missed rescale or GQA term all give errors of 1e-3 .. 1).
constexpr double kFwdTol = 3e-6;
constexpr double kLseTol = 3e-6;  // max abs, for scores of std ~1 (measured <= 8e-7)
constexpr double kBwdTol = 1e-5;

const std::vector<Dims> kShapes = {
    {2, 37, 6, 2, 48},
    {2, 37, 4, 4, 64},
    {2, 130, 6, 2, 48},
    {2, 130, 4, 4, 64},
    {2, 37, 6, 2, 64},
    {2, 130, 6, 2, 64},
    {2, 130, 4, 4, 48},
    {1, 1, 2, 1, 64},
    {1, 64, 2, 2, 64},
    {1, 200, 4, 1, 48},
    {2, 70, 4, 2, 20},
    {1, 90, 2, 1, 128},
    {1, 129, 2, 2, 16},
    {1, 50, 3, 3, 32},
    // Head dims whose vectors split into other register blocks per tier: 24 and 72 (3 vectors of
    // 8 on AVX2), 40 and 56 (odd counts), 128 (16 vectors of 8, 32 of 4 on the baseline).
    {1, 70, 2, 1, 24},
    {1, 70, 2, 2, 40},
    {1, 37, 2, 1, 56},
    {1, 70, 2, 1, 72},
    {2, 130, 4, 2, 128},
};

TEST(Attention, ForwardMatchesNaiveFp64) {
  for (const Dims& d : kShapes) {
    for (float input_scale : {1.0f, 3.0f}) {  // 3.0: scores of std ~9 stress the online rescale
      Case c(d, 100 + d.T + d.D, input_scale);
      std::vector<double> out, lse;
      naive_forward(d, c.dense(), c.scale, out, lse);
      test::for_each_isa([&](cpu::Isa) {
        Result r = run_kernel(c, /*fused=*/false, /*backward=*/false);
        EXPECT_LT(test::rel_l2(r.out, out), kFwdTol) << name(d) << " input_scale=" << input_scale;
        // lse inherits the absolute rounding of the fp32 scores, which grows with their size.
        EXPECT_LT(test::max_abs_diff(r.lse, lse), kLseTol * input_scale * input_scale) << name(d);
      });
    }
  }
}

TEST(Attention, BackwardMatchesNaiveAnalyticFp64) {
  for (const Dims& d : kShapes) {
    Case c(d, 200 + d.T + d.D);
    const Dense g = naive_backward(d, c.dense(), test::to_double(c.dout), c.scale);
    test::for_each_isa([&](cpu::Isa) {
      Result r = run_kernel(c, /*fused=*/false);
      if (d.T == 1) {  // one key per query: P = 1, dS = 0, so dq = dk = 0 up to rounding
        EXPECT_LT(test::max_abs_diff(r.dq, g.q), 1e-6) << name(d) << " dq";
        EXPECT_LT(test::max_abs_diff(r.dk, g.k), 1e-6) << name(d) << " dk";
      } else {
        EXPECT_LT(test::rel_l2(r.dq, g.q), kBwdTol) << name(d) << " dq";
        EXPECT_LT(test::rel_l2(r.dk, g.k), kBwdTol) << name(d) << " dk";
      }
      EXPECT_LT(test::rel_l2(r.dv, g.v), kBwdTol) << name(d) << " dv";
    });
  }
}

double naive_loss(const Dims& d, const Dense& x, const std::vector<double>& r, double scale) {
  std::vector<double> out, lse;
  naive_forward(d, x, scale, out, lse);
  double L = 0;
  for (size_t i = 0; i < out.size(); ++i) L += out[i] * r[i];
  return L;
}

// The analytic fp64 reference used above is itself checked against finite differences.
TEST(Attention, NaiveGradientMatchesFiniteDifferences) {
  const Dims d{2, 6, 4, 2, 5};
  Case c(d, 7);
  const Dense x = c.dense();
  const auto r = test::to_double(c.dout);
  const Dense g = naive_backward(d, x, r, c.scale);
  for (int which = 0; which < 3; ++which) {
    auto f = [&](const std::vector<double>& p) {
      Dense y = x;
      (which == 0 ? y.q : which == 1 ? y.k : y.v) = p;
      return naive_loss(d, y, r, c.scale);
    };
    const auto& p0 = which == 0 ? x.q : which == 1 ? x.k : x.v;
    const auto num = test::numeric_grad(f, p0);
    const auto& ana = which == 0 ? g.q : which == 1 ? g.k : g.v;
    EXPECT_LT(test::rel_l2(ana, num), 1e-8) << "input " << which;
  }
}

// The kernel's fp32 gradient against fp64 central differences of the naive attention, on all
// coordinates of a small problem and on sampled coordinates of one that spans several tiles.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  struct FdCase {
    Dims d;
    int64_t samples;  // 0: every coordinate
  };
  for (const FdCase& fc : {FdCase{{2, 9, 4, 2, 16}, 0}, FdCase{{1, 70, 2, 1, 48}, 150},
                           FdCase{{1, 67, 4, 4, 64}, 150}}) {
    const Dims& d = fc.d;
    Case c(d, 300 + d.T);
    const Dense x = c.dense();
    const auto r = test::to_double(c.dout);
    // Per input (q, k, v): the sampled coordinates and their central differences.
    std::vector<int64_t> idx[3];
    std::vector<double> num[3];
    for (int which = 0; which < 3; ++which) {
      const auto& p0 = which == 0 ? x.q : which == 1 ? x.k : x.v;
      const int64_t n = int64_t(p0.size());
      if (fc.samples == 0) {
        for (int64_t i = 0; i < n; ++i) idx[which].push_back(i);
      } else {
        std::mt19937_64 rng(which + 11);
        for (int64_t s = 0; s < fc.samples; ++s) idx[which].push_back(int64_t(rng() % uint64_t(n)));
      }
      Dense y = x;
      auto& p = which == 0 ? y.q : which == 1 ? y.k : y.v;
      const double h = 1e-5;
      for (int64_t i : idx[which]) {
        const double v0 = p[i];
        p[i] = v0 + h;
        const double fp = naive_loss(d, y, r, c.scale);
        p[i] = v0 - h;
        const double fm = naive_loss(d, y, r, c.scale);
        p[i] = v0;
        num[which].push_back((fp - fm) / (2 * h));
      }
    }
    test::for_each_isa([&](cpu::Isa) {
      Result res = run_kernel(c, /*fused=*/true);
      for (int which = 0; which < 3; ++which) {
        const auto& kern = which == 0 ? res.dq : which == 1 ? res.dk : res.dv;
        std::vector<double> got;
        for (int64_t i : idx[which]) got.push_back(kern[i]);
        EXPECT_LT(test::rel_l2(got, num[which]), kBwdTol) << name(d) << " input " << which;
      }
    });
  }
}

// q/k/v inside a fused buffer with gaps give bit-identical results to contiguous tensors (the
// arithmetic does not depend on the strides), and the gaps of dq/dk/dv are untouched (checked in
// run_kernel).
TEST_ALL_ISAS(Attention, StridedFusedLayoutMatchesContiguous) {
  for (const Dims& d : {Dims{2, 130, 6, 2, 48}, Dims{2, 37, 4, 4, 64}, Dims{1, 70, 4, 2, 20}}) {
    Case c(d, 400 + d.T);
    Result a = run_kernel(c, /*fused=*/false);
    Result b = run_kernel(c, /*fused=*/true);
    EXPECT_EQ(a.out, b.out) << name(d);
    EXPECT_EQ(a.lse, b.lse) << name(d);
    EXPECT_EQ(a.dq, b.dq) << name(d);
    EXPECT_EQ(a.dk, b.dk) << name(d);
    EXPECT_EQ(a.dv, b.dv) << name(d);
  }
}

// Work is split so that each output element has one writer and a fixed summation order: results
// are bit-identical for any thread count. With few (batch, kv group) units per thread the
// backward switches to its split scheme (dk/dv per key tile, dq per query tile), which must
// agree bit for bit with the fused one and with the fp64 reference.
TEST(Attention, DeterministicAcrossThreadCountsAndSchemes) {
  const int saved = omp_get_max_threads();
  // B*Hkv = 12, 1, 2, 1: with 4 threads the last three take the split scheme, with 1 the fused.
  for (const Dims& d : {Dims{2, 130, 6, 6, 64}, Dims{1, 200, 4, 1, 48}, Dims{2, 150, 2, 1, 64},
                        Dims{1, 70, 3, 1, 20}}) {
    Case c(d, 500 + d.T);
    const Dense g = naive_backward(d, c.dense(), test::to_double(c.dout), c.scale);
    test::for_each_isa([&](cpu::Isa) {
      omp_set_num_threads(1);
      Result one = run_kernel(c, true);
      omp_set_num_threads(4);
      Result four = run_kernel(c, true);
      omp_set_num_threads(saved);
      EXPECT_EQ(one.out, four.out) << name(d);
      EXPECT_EQ(one.lse, four.lse) << name(d);
      EXPECT_EQ(one.dq, four.dq) << name(d);
      EXPECT_EQ(one.dk, four.dk) << name(d);
      EXPECT_EQ(one.dv, four.dv) << name(d);
      EXPECT_LT(test::rel_l2(four.dq, g.q), kBwdTol) << name(d);
      EXPECT_LT(test::rel_l2(four.dk, g.k), kBwdTol) << name(d);
      EXPECT_LT(test::rel_l2(four.dv, g.v), kBwdTol) << name(d);
    });
  }
}

TEST(Attention, RejectsBadShapes) {
  std::vector<float> buf(4096, 1.0f);
  float* p = buf.data();
  AttentionShape s{1, 4, 6, 4, 8, 48, 32, 0.3f};  // Hq not a multiple of Hkv
  EXPECT_THROW(cpu::attention_forward(s, p, p, p, p, p), Error);
  s = AttentionShape{1, 4, 4, 2, 8, 16, 16, 0.3f};  // q_stride < Hq*D
  EXPECT_THROW(cpu::attention_forward(s, p, p, p, p, p), Error);
  s = AttentionShape{1, 4, 4, 2, 8, 32, 8, 0.3f};  // kv_stride < Hkv*D
  EXPECT_THROW(cpu::attention_backward(s, p, p, p, p, p, p, p, p, p), Error);
  s = AttentionShape{1, 4, 4, 2, 8, 32, 16, 0.0f};  // no scale
  EXPECT_THROW(cpu::attention_forward(s, p, p, p, p, p), Error);
  try {
    cpu::attention_forward(AttentionShape{1, 4, 6, 4, 8, 48, 32, 0.3f}, p, p, p, p, p);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of Hkv"), std::string::npos) << e.what();
  }
}

}  // namespace
