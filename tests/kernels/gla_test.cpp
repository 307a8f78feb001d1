#include "kernels/cpu/gla.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

struct Dims {
  int64_t B, T, H, Hkv, K, V;
};

std::string name(const Dims& d) {
  return str_cat("B", d.B, " T", d.T, " H", d.H, " Hkv", d.Hkv, " K", d.K, " V", d.V);
}

// Inputs as fla's tests draw them and wider: q, k, v, h0, dout, dht ~ N(0, 1); gk =
// logsigmoid(z) / normalizer with z ~ N(0, logit_std^2), so a small normalizer and wide logits
// give decays down to e^-hundreds per token.
struct Inputs {
  Dims d;
  std::vector<float> q, k, v, gk, h0, dout, dht;
};

Inputs make_inputs(const Dims& d, float normalizer, float logit_std, uint64_t seed) {
  Inputs in{d, {}, {}, {}, {}, {}, {}, {}};
  const size_t M = size_t(d.B * d.T);
  in.q = test::randn(M * d.H * d.K, seed);
  in.k = test::randn(M * d.Hkv * d.K, seed + 1);
  in.v = test::randn(M * d.Hkv * d.V, seed + 2);
  in.gk = test::randn(M * d.Hkv * d.K, seed + 3, logit_std);
  for (float& z : in.gk)
    z = float((std::min(double(z), 0.0) - std::log1p(std::exp(-std::abs(double(z))))) / normalizer);
  in.h0 = test::randn(size_t(d.B * d.H * d.K * d.V), seed + 4);
  in.dout = test::randn(M * d.H * d.V, seed + 5);
  in.dht = test::randn(size_t(d.B * d.H * d.K * d.V), seed + 6);
  return in;
}

struct Result {
  std::vector<double> o, ht, dq, dk, dv, dgk, dh0;
};

// The recurrence token by token in fp64 (forward) and its reverse sweep (backward):
//   S_t = Diag(e^gk_t) S_{t-1} + k_t v_t^T, o_t = s S_t^T q_t, L = sum o.dout + sum S_T.dht.
Result naive(const Inputs& in) {
  const Dims& d = in.d;
  const int64_t G = d.H / d.Hkv, K = d.K, V = d.V;
  const double s = 1.0 / std::sqrt(double(K));
  Result r;
  const size_t M = size_t(d.B * d.T);
  r.o.assign(M * d.H * V, 0);
  r.ht.assign(size_t(d.B * d.H * K * V), 0);
  r.dq.assign(M * d.H * K, 0);
  r.dk.assign(M * d.Hkv * K, 0);
  r.dv.assign(M * d.Hkv * V, 0);
  r.dgk.assign(M * d.Hkv * K, 0);
  r.dh0.assign(size_t(d.B * d.H * K * V), 0);
  std::vector<double> S(size_t((d.T + 1) * K * V)), dS(size_t(K * V));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t hk = h / G;
      const size_t head = size_t((b * d.H + h) * K * V);
      auto q = [&](int64_t t, int64_t i) {
        return double(in.q[((b * d.T + t) * d.H + h) * K + i]);
      };
      auto k = [&](int64_t t, int64_t i) {
        return double(in.k[((b * d.T + t) * d.Hkv + hk) * K + i]);
      };
      auto v = [&](int64_t t, int64_t i) {
        return double(in.v[((b * d.T + t) * d.Hkv + hk) * V + i]);
      };
      auto g = [&](int64_t t, int64_t i) {
        return double(in.gk[((b * d.T + t) * d.Hkv + hk) * K + i]);
      };
      auto dO = [&](int64_t t, int64_t i) {
        return double(in.dout[((b * d.T + t) * d.H + h) * V + i]);
      };
      for (int64_t i = 0; i < K * V; ++i) S[i] = in.h0[head + i];
      for (int64_t t = 0; t < d.T; ++t) {
        double* Sp = S.data() + t * K * V;
        double* St = Sp + K * V;
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j)
            St[i * V + j] = std::exp(g(t, i)) * Sp[i * V + j] + k(t, i) * v(t, j);
        for (int64_t j = 0; j < V; ++j) {
          double o = 0;
          for (int64_t i = 0; i < K; ++i) o += q(t, i) * St[i * V + j];
          r.o[((b * d.T + t) * d.H + h) * V + j] = s * o;
        }
      }
      for (int64_t i = 0; i < K * V; ++i) r.ht[head + i] = S[d.T * K * V + i];
      for (int64_t i = 0; i < K * V; ++i) dS[i] = in.dht[head + i];
      for (int64_t t = d.T - 1; t >= 0; --t) {
        const double* St = S.data() + (t + 1) * K * V;
        const double* Sp = S.data() + t * K * V;
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) dS[i * V + j] += s * q(t, i) * dO(t, j);
        for (int64_t i = 0; i < K; ++i) {
          double dq = 0, dk = 0, dg = 0;
          for (int64_t j = 0; j < V; ++j) {
            dq += St[i * V + j] * dO(t, j);
            dk += dS[i * V + j] * v(t, j);
            dg += Sp[i * V + j] * dS[i * V + j];
          }
          r.dq[((b * d.T + t) * d.H + h) * K + i] = s * dq;
          r.dk[((b * d.T + t) * d.Hkv + hk) * K + i] += dk;
          r.dgk[((b * d.T + t) * d.Hkv + hk) * K + i] += std::exp(g(t, i)) * dg;
        }
        for (int64_t j = 0; j < V; ++j) {
          double dv = 0;
          for (int64_t i = 0; i < K; ++i) dv += dS[i * V + j] * k(t, i);
          r.dv[((b * d.T + t) * d.Hkv + hk) * V + j] += dv;
        }
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) dS[i * V + j] *= std::exp(g(t, i));
      }
      for (int64_t i = 0; i < K * V; ++i) r.dh0[head + i] = dS[i];
    }
  return r;
}

struct Out {
  std::vector<float> o, ht, dq, dk, dv, dgk, dh0;
};

Out run(const Inputs& in, int64_t chunk = 64, int64_t sub_chunk = 16) {
  const Dims& d = in.d;
  cpu::GlaCore a;
  a.B = d.B, a.T = d.T, a.H = d.H, a.Hkv = d.Hkv, a.K = d.K, a.V = d.V;
  a.scale = 1.0f / std::sqrt(float(d.K));
  a.chunk = chunk, a.sub_chunk = sub_chunk;
  a.q = {in.q.data(), 0}, a.k = {in.k.data(), 0}, a.v = {in.v.data(), 0};
  a.gk = {in.gk.data(), 0}, a.h0 = in.h0.data();
  Out out;
  const float nan = std::numeric_limits<float>::quiet_NaN();  // every output must be written
  out.o.assign(in.dout.size(), nan);
  out.ht.assign(in.h0.size(), nan);
  out.dq.assign(in.q.size(), nan);
  out.dk.assign(in.k.size(), nan);
  out.dv.assign(in.v.size(), nan);
  out.dgk.assign(in.gk.size(), nan);
  out.dh0.assign(in.h0.size(), nan);
  cpu::gla_forward(a, {out.o.data(), 0}, out.ht.data());
  cpu::GlaCoreGrads g{{out.dq.data(), 0},
                      {out.dk.data(), 0},
                      {out.dv.data(), 0},
                      {out.dgk.data(), 0},
                      out.dh0.data()};
  cpu::gla_backward(a, {in.dout.data(), 0}, in.dht.data(), g);
  return out;
}

void expect_close(const Out& o, const Result& r, double tol, const std::string& what) {
  const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<double>*>>
      pairs[] = {{"o", {&o.o, &r.o}},      {"ht", {&o.ht, &r.ht}}, {"dq", {&o.dq, &r.dq}},
                 {"dk", {&o.dk, &r.dk}},   {"dv", {&o.dv, &r.dv}}, {"dgk", {&o.dgk, &r.dgk}},
                 {"dh0", {&o.dh0, &r.dh0}}};
  for (const auto& [n, p] : pairs) {
    for (float x : *p.first) {
      ASSERT_TRUE(std::isfinite(x)) << what << " " << n;
    }
    EXPECT_LT(test::rel_l2(*p.first, *p.second), tol) << what << " " << n;
  }
}

void check_against_naive(const std::vector<Dims>& shapes, float normalizer, float logit_std,
                         double tol) {
  uint64_t seed = 10;
  for (const Dims& d : shapes) {
    const Inputs in = make_inputs(d, normalizer, logit_std, seed += 10);
    const Result ref = naive(in);
    test::for_each_isa([&](cpu::Isa) { expect_close(run(in), ref, tol, name(d)); });
  }
}

// T not a multiple of the chunk (64) nor of the sub-chunk (16), one token, one partial chunk,
// GQA with 2 and 4 query heads per kv head, K and V not multiples of any vector width.
const std::vector<Dims> kShapes = {{2, 67, 4, 2, 32, 48},
                                   {1, 1, 2, 2, 16, 16},
                                   {1, 17, 2, 2, 60, 20},
                                   {1, 130, 4, 1, 24, 40},
                                   {2, 64, 2, 2, 16, 32}};

}  // namespace

// fla's default gate (normalizer 16) with logits N(0, 3^2): the f32 chunked kernel against the
// fp64 recurrence. fla's metric (RMSE / RMS of the reference), expected ~1e-7.
TEST(GlaCore, MatchesFp64RecurrenceMildDecay) {
  check_against_naive(kShapes, 16.0f, 3.0f, 1e-5);
}

// Normalizer 0.1 and logits N(0, 30^2): per-token decays to e^-300, chunk-local cumsums to
// -10^4. A one-level factorization (e^-b) overflows here; the sub-chunked one must stay accurate,
// finite and free of denormals.
TEST(GlaCore, MatchesFp64RecurrenceExtremeDecay) {
  check_against_naive({{2, 67, 4, 2, 32, 48}, {1, 130, 2, 1, 24, 40}}, 0.1f, 30.0f, 1e-5);
}

TEST(GlaCore, MatchesFp64RecurrenceNormalizerOne) {
  check_against_naive({{1, 100, 2, 2, 32, 32}}, 1.0f, 3.0f, 1e-5);
}

// The chunk and sub-chunk sizes only regroup the same sums.
TEST(GlaCore, ChunkSizeInvariance) {
  const Inputs in = make_inputs({2, 77, 4, 2, 32, 24}, 1.0f, 3.0f, 7);
  test::for_each_isa([&](cpu::Isa) {
    const Out base = run(in, 64, 16);
    for (auto [C, c] :
         std::vector<std::pair<int64_t, int64_t>>{{16, 4}, {32, 8}, {32, 32}, {7, 3}}) {
      const Out o = run(in, C, c);
      const std::string what = str_cat("chunk ", C, " sub ", c);
      EXPECT_LT(test::rel_l2(o.o, base.o), 1e-6) << what;
      EXPECT_LT(test::rel_l2(o.ht, base.ht), 1e-6) << what;
      EXPECT_LT(test::rel_l2(o.dq, base.dq), 1e-6) << what;
      EXPECT_LT(test::rel_l2(o.dk, base.dk), 1e-6) << what;
      EXPECT_LT(test::rel_l2(o.dv, base.dv), 1e-6) << what;
      EXPECT_LT(test::rel_l2(o.dgk, base.dgk), 1e-6) << what;
      EXPECT_LT(test::rel_l2(o.dh0, base.dh0), 1e-6) << what;
    }
  });
}

// Bitwise the same results with 1 thread and with several.
TEST_ALL_ISAS(GlaCore, DeterministicAcrossThreadCounts) {
  const Inputs in = make_inputs({3, 70, 4, 2, 16, 24}, 16.0f, 3.0f, 8);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Out one = run(in);
  omp_set_num_threads(std::max(threads, 3));
  const Out many = run(in);
  omp_set_num_threads(threads);
  EXPECT_EQ(one.o, many.o);
  EXPECT_EQ(one.ht, many.ht);
  EXPECT_EQ(one.dq, many.dq);
  EXPECT_EQ(one.dk, many.dk);
  EXPECT_EQ(one.dv, many.dv);
  EXPECT_EQ(one.dgk, many.dgk);
  EXPECT_EQ(one.dh0, many.dh0);
}

// q, k, v and gk read as views into one fused buffer (row stride > width), and o, dq.. written
// into strided buffers, give the contiguous results bit for bit.
TEST_ALL_ISAS(GlaCore, StridedViewsEqualContiguous) {
  const Dims d{2, 40, 4, 2, 16, 24};
  const Inputs in = make_inputs(d, 16.0f, 3.0f, 9);
  const Out ref = run(in);
  const int64_t M = d.B * d.T, wq = d.H * d.K, wk = d.Hkv * d.K, wv = d.Hkv * d.V;
  const int64_t ld = wq + wk + wv + wk + 3;
  std::vector<float> fused(size_t(M * ld), 0.5f), dfused(size_t(M * ld), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    std::copy_n(in.q.data() + m * wq, wq, fused.data() + m * ld);
    std::copy_n(in.k.data() + m * wk, wk, fused.data() + m * ld + wq);
    std::copy_n(in.v.data() + m * wv, wv, fused.data() + m * ld + wq + wk);
    std::copy_n(in.gk.data() + m * wk, wk, fused.data() + m * ld + wq + wk + wv);
  }
  cpu::GlaCore a;
  a.B = d.B, a.T = d.T, a.H = d.H, a.Hkv = d.Hkv, a.K = d.K, a.V = d.V;
  a.scale = 1.0f / std::sqrt(float(d.K));
  a.q = {fused.data(), ld}, a.k = {fused.data() + wq, ld}, a.v = {fused.data() + wq + wk, ld};
  a.gk = {fused.data() + wq + wk + wv, ld}, a.h0 = in.h0.data();
  const int64_t ldo = d.H * d.V + 5;
  std::vector<float> o(size_t(M * ldo)), ht(in.h0.size()), dh0(in.h0.size());
  cpu::gla_forward(a, {o.data(), ldo}, ht.data());
  std::vector<float> dout(size_t(M * ldo));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < d.H * d.V; ++i) {
      ASSERT_EQ(o[m * ldo + i], ref.o[m * d.H * d.V + i]);
      dout[m * ldo + i] = in.dout[m * d.H * d.V + i];
    }
  }
  EXPECT_EQ(ht, ref.ht);
  cpu::GlaCoreGrads g{{dfused.data(), ld},
                      {dfused.data() + wq, ld},
                      {dfused.data() + wq + wk, ld},
                      {dfused.data() + wq + wk + wv, ld},
                      dh0.data()};
  cpu::gla_backward(a, {dout.data(), ldo}, in.dht.data(), g);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < wq; ++i) ASSERT_EQ(dfused[m * ld + i], ref.dq[m * wq + i]);
    for (int64_t i = 0; i < wk; ++i) ASSERT_EQ(dfused[m * ld + wq + i], ref.dk[m * wk + i]);
    for (int64_t i = 0; i < wv; ++i) ASSERT_EQ(dfused[m * ld + wq + wk + i], ref.dv[m * wv + i]);
    for (int64_t i = 0; i < wk; ++i)
      ASSERT_EQ(dfused[m * ld + wq + wk + wv + i], ref.dgk[m * wk + i]);
  }
  EXPECT_EQ(dh0, ref.dh0);
}

// A decay below e^-87 is exactly 0, not e^-87 nor a denormal: with gk = -100 at the only token,
// dh0 = e^gk (dht + s q dout^T) must be exactly zero (in fp64 it is ~1e-43, a denormal in f32).
TEST_ALL_ISAS(GlaCore, FlushesDecayBelowMinus87ToZero) {
  Inputs in = make_inputs({1, 1, 2, 1, 16, 24}, 16.0f, 3.0f, 11);
  for (float& g : in.gk) g = -100.0f;
  const Out out = run(in);
  for (float x : out.dh0) ASSERT_EQ(x, 0.0f);
  // The state after the token holds k v^T alone: the decayed h0 contributes exactly nothing.
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t j = 0; j < 24; ++j)
        ASSERT_EQ(out.ht[(h * 16 + i) * 24 + j], in.k[i] * in.v[j]) << h << " " << i << " " << j;
}

TEST(GlaCore, RejectsBadShapes) {
  cpu::GlaCore a;
  a.B = 1, a.T = 4, a.H = 3, a.Hkv = 2, a.K = 8, a.V = 8, a.scale = 1;
  float x = 0;
  test::expect_error(
      [&] {
        cpu::gla_forward(a, {&x, 0}, nullptr);
      },
      {"gla_forward", "num_kv_heads", "3", "2"});
  a.H = 2, a.sub_chunk = 128;
  test::expect_error([&] { cpu::gla_forward(a, {&x, 0}, nullptr); }, {"sub_chunk", "128"});
  a.sub_chunk = 16, a.q.ld = 4;
  test::expect_error([&] { cpu::gla_forward(a, {&x, 0}, nullptr); }, {"row stride of q", "16"});
}

namespace {

// Rows [t0, t0 + n) of every sample of a [B*T, W] tensor, as a [B*n, W] tensor, and back.
std::vector<float> take(const std::vector<float>& x, int64_t B, int64_t T, int64_t t0, int64_t n) {
  const int64_t W = int64_t(x.size()) / (B * T);
  std::vector<float> out(size_t(B * n * W));
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(x.data() + (b * T + t0) * W, n * W, out.data() + b * n * W);
  return out;
}
void put(const std::vector<float>& seg, int64_t B, int64_t T, int64_t t0, int64_t n,
         std::vector<float>& x) {
  const int64_t W = int64_t(x.size()) / (B * T);
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(seg.data() + b * n * W, n * W, x.data() + (b * T + t0) * W);
}

// S_out = Diag(e^a) S_in + E per (sample, query head): a [B, Hkv, K] is a segment's total
// log-decay (its kv head's), E [B, H, K, V] its final state from zero.
std::vector<float> fold(const Dims& d, const std::vector<float>& a, const std::vector<float>& S,
                        const std::vector<float>& E) {
  std::vector<float> out(S.size());
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t i = 0; i < d.K; ++i) {
        const float e = std::exp(a[(b * d.Hkv + h / (d.H / d.Hkv)) * d.K + i]);
        for (int64_t j = 0; j < d.V; ++j) {
          const size_t x = size_t(((b * d.H + h) * d.K + i) * d.V + j);
          out[x] = e * S[x] + E[x];
        }
      }
  return out;
}

}  // namespace

// Context parallelism by state passing (spec section 9), in one process: the sequence cut into
// segments of unequal lengths; each segment's zero-start final state and total decay, a prefix
// fold for the starting states, then each segment's forward from its state; backward with each
// segment's dh0 from dht = 0 and a suffix fold for its dht. Every output and gradient equals the
// unsplit run's; starting every segment from zero (what a trainer without state passing does) is
// far off.
TEST(GlaCore, StatePassingAcrossSegmentsEqualsUnsplit) {
  const Dims d{2, 130, 4, 2, 16, 24};
  const Inputs in = make_inputs(d, 4.0f, 3.0f, 21);
  const Out whole = run(in);
  const std::vector<int64_t> cuts = {0, 20, 67, 100, 130};
  const size_t nseg = cuts.size() - 1, state = in.h0.size();
  std::vector<Inputs> seg;
  std::vector<std::vector<float>> a(nseg), E(nseg), D(nseg);
  for (size_t s = 0; s < nseg; ++s) {
    const int64_t t0 = cuts[s], n = cuts[s + 1] - cuts[s];
    Inputs x{{d.B, n, d.H, d.Hkv, d.K, d.V}, take(in.q, d.B, d.T, t0, n),
             take(in.k, d.B, d.T, t0, n),    take(in.v, d.B, d.T, t0, n),
             take(in.gk, d.B, d.T, t0, n),   std::vector<float>(state, 0.0f),
             take(in.dout, d.B, d.T, t0, n), std::vector<float>(state, 0.0f)};
    a[s].assign(size_t(d.B * d.Hkv * d.K), 0.0f);
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < d.Hkv * d.K; ++i)
          a[s][b * d.Hkv * d.K + i] += x.gk[(b * n + t) * d.Hkv * d.K + i];
    const Out zero = run(x);  // from h0 = 0 with dht = 0: the summaries E and D
    E[s] = zero.ht;
    D[s] = zero.dh0;
    seg.push_back(std::move(x));
  }
  Out joined{std::vector<float>(whole.o.size()),
             {},
             std::vector<float>(whole.dq.size()),
             std::vector<float>(whole.dk.size()),
             std::vector<float>(whole.dv.size()),
             std::vector<float>(whole.dgk.size()),
             {}};
  std::vector<std::vector<float>> S_in(nseg), dS_out(nseg);
  S_in[0] = in.h0;
  for (size_t s = 0; s + 1 < nseg; ++s) S_in[s + 1] = fold(d, a[s], S_in[s], E[s]);
  dS_out[nseg - 1] = in.dht;
  for (size_t s = nseg - 1; s-- > 0;) dS_out[s] = fold(d, a[s + 1], dS_out[s + 1], D[s + 1]);
  for (bool passing : {true, false}) {
    for (size_t s = 0; s < nseg; ++s) {
      Inputs x = seg[s];
      x.h0 = passing || s == 0 ? S_in[s] : std::vector<float>(state, 0.0f);
      x.dht = passing || s + 1 == nseg ? dS_out[s] : std::vector<float>(state, 0.0f);
      const Out o = run(x);
      const int64_t t0 = cuts[s], n = cuts[s + 1] - cuts[s];
      put(o.o, d.B, d.T, t0, n, joined.o);
      put(o.dq, d.B, d.T, t0, n, joined.dq);
      put(o.dk, d.B, d.T, t0, n, joined.dk);
      put(o.dv, d.B, d.T, t0, n, joined.dv);
      put(o.dgk, d.B, d.T, t0, n, joined.dgk);
      if (s == 0) joined.dh0 = o.dh0;
      if (s + 1 == nseg) joined.ht = o.ht;
    }
    if (passing) {
      EXPECT_LT(test::rel_l2(joined.o, whole.o), 1e-6);
      EXPECT_LT(test::rel_l2(joined.ht, whole.ht), 1e-6);
      EXPECT_LT(test::rel_l2(joined.dq, whole.dq), 1e-6);
      EXPECT_LT(test::rel_l2(joined.dk, whole.dk), 1e-6);
      EXPECT_LT(test::rel_l2(joined.dv, whole.dv), 1e-6);
      EXPECT_LT(test::rel_l2(joined.dgk, whole.dgk), 1e-6);
      EXPECT_LT(test::rel_l2(joined.dh0, whole.dh0), 1e-6);
    } else {
      EXPECT_GT(test::rel_l2(joined.o, whole.o), 1e-2);
      EXPECT_GT(test::rel_l2(joined.dk, whole.dk), 1e-2);
    }
  }
}

// The state-passing pieces: a segment's total decay and the fold S <- e^decay S + E (GQA: a
// query head folds with its kv head's decay), against fp64.
TEST_ALL_ISAS(GlaCore, DecayTotalAndStateFold) {
  const int64_t B = 2, T = 13, H = 4, Hkv = 2, K = 24, V = 20;
  const auto gk = test::randn(size_t(B * T * Hkv * K), 31, 0.3f);
  std::vector<float> decay(size_t(B * Hkv * K));
  cpu::gla_decay_total(B, T, Hkv, K, gk.data(), decay.data());
  std::vector<double> want(decay.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < Hkv * K; ++i)
        want[size_t(b * Hkv * K + i)] += gk[size_t((b * T + t) * Hkv * K + i)];
  EXPECT_LT(test::rel_l2(decay, want), 1e-6);
  auto S = test::randn(size_t(B * H * K * V), 32);
  const auto E = test::randn(S.size(), 33);
  std::vector<double> ref(S.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) {
          const size_t x = size_t(((b * H + h) * K + i) * V + j);
          ref[x] = std::exp(double(decay[size_t((b * Hkv + h / 2) * K + i)])) * S[x] + E[x];
        }
  cpu::gla_state_fold(B, H, Hkv, K, V, decay.data(), E.data(), S.data());
  EXPECT_LT(test::rel_l2(S, ref), 1e-6);
}
