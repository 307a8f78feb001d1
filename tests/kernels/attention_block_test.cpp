// Block attention with global positions (the kernel of ring attention): each simulated cp rank's
// queries against every rank's keys, merged by lse, must equal plain causal attention over the
// whole sequence (fp64 reference); the summed block backward must equal fp64 finite differences.
#include "kernels/cpu/attention_block.hpp"

#include <cmath>
#include <limits>

#include "tests/test_util.hpp"

namespace loom {
namespace {

using cpu::BlockShape;

struct Dims {
  int64_t B, T, Hq, Hkv, D;
  int64_t stride() const { return (Hq + 2 * Hkv) * D; }  // fused qkv rows, as the model has
};

// qkv[b, t, :] = [q heads | k heads | v heads]; returns out[b, t, h, :] and lse[b, h, t].
void naive(const Dims& d, const std::vector<double>& qkv, std::vector<double>& out,
           std::vector<double>& lse) {
  const int64_t S = d.stride(), group = d.Hq / d.Hkv;
  out.assign(static_cast<size_t>(d.B * d.T * d.Hq * d.D), 0.0);
  lse.assign(static_cast<size_t>(d.B * d.Hq * d.T), 0.0);
  const double scale = 1.0 / std::sqrt(double(d.D));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.T; ++i) {
        const double* q = &qkv[(b * d.T + i) * S + h * d.D];
        std::vector<double> s(static_cast<size_t>(i + 1));
        double m = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          const double* k = &qkv[(b * d.T + j) * S + (d.Hq + h / group) * d.D];
          double dot = 0;
          for (int64_t e = 0; e < d.D; ++e) dot += q[e] * k[e];
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - m));
        for (int64_t j = 0; j <= i; ++j) {
          const double* v = &qkv[(b * d.T + j) * S + (d.Hq + d.Hkv + h / group) * d.D];
          for (int64_t e = 0; e < d.D; ++e)
            out[((b * d.T + i) * d.Hq + h) * d.D + e] += s[j] / sum * v[e];
        }
        lse[(b * d.Hq + h) * d.T + i] = m + std::log(sum);
      }
}

// The rows of qkv at the given positions, every sample: a cp rank's local copy.
std::vector<float> gather_rows(const Dims& d, const std::vector<float>& qkv,
                               const std::vector<int64_t>& pos) {
  const int64_t S = d.stride(), n = int64_t(pos.size());
  std::vector<float> r(static_cast<size_t>(d.B * n * S));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < n; ++t)
      std::copy_n(&qkv[(b * d.T + pos[t]) * S], S, &r[(b * n + t) * S]);
  return r;
}

BlockShape shape(const Dims& d, int64_t Tq, int64_t Tk) {
  return {d.B, Tq, Tk, d.Hq, d.Hkv, d.D, d.stride(), d.stride(), float(1.0 / std::sqrt(d.D))};
}

struct RingResult {
  std::vector<float> out, lse, dqkv;  // global order; dqkv only when dout is given
  int64_t skipped = 0;
};

// Every rank r: out/lse of its queries = merge over source ranks s of block(q_r, kv_s), skipping
// blocks with no causal entry. With dout: Di from the final out, then every block pair's
// backward adds dq into rank r and dk/dv into rank s (what the ring's rotating accumulators do).
RingResult ring(const Dims& d, int64_t cp, const std::vector<float>& qkv,
                const std::vector<float>* dout_global) {
  const int64_t S = d.stride(), n = d.T / cp, HD = d.Hq * d.D;
  std::vector<std::vector<int64_t>> pos(cp);
  std::vector<std::vector<float>> local(cp), grad(cp);
  for (int64_t r = 0; r < cp; ++r) {
    pos[r] = cpu::cp_positions(d.T, cp, r);
    local[r] = gather_rows(d, qkv, pos[r]);
    grad[r].assign(local[r].size(), 0.0f);
  }
  RingResult res;
  res.out.assign(static_cast<size_t>(d.B * d.T * HD), 0.0f);
  res.lse.assign(static_cast<size_t>(d.B * d.Hq * d.T), 0.0f);
  res.dqkv.assign(qkv.size(), 0.0f);
  const auto bs = shape(d, n, n);
  for (int64_t r = 0; r < cp; ++r) {
    std::vector<float> out(static_cast<size_t>(d.B * n * HD)), lse(d.B * d.Hq * n, -INFINITY);
    std::vector<float> ob(out.size()), lb(lse.size());
    std::fill(out.begin(), out.end(), 0.0f);
    for (int64_t s = 0; s < cp; ++s) {
      if (cpu::causal_entries(pos[r].data(), n, pos[s].data(), n) == 0) {
        ++res.skipped;
        continue;
      }
      const float* kv = local[s].data();
      cpu::attention_block_forward(bs, local[r].data(), kv + d.Hq * d.D, kv + (d.Hq + d.Hkv) * d.D,
                                   pos[r].data(), pos[s].data(), ob.data(), lb.data());
      cpu::attention_merge(d.B, n, d.Hq, d.D, out.data(), lse.data(), ob.data(), lb.data());
    }
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t t = 0; t < n; ++t) {
        std::copy_n(&out[(b * n + t) * HD], HD, &res.out[(b * d.T + pos[r][t]) * HD]);
        for (int64_t h = 0; h < d.Hq; ++h)
          res.lse[(b * d.Hq + h) * d.T + pos[r][t]] = lse[(b * d.Hq + h) * n + t];
      }
    if (!dout_global) continue;
    std::vector<float> dout(out.size()), delta(lse.size());
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t t = 0; t < n; ++t)
        std::copy_n(&(*dout_global)[(b * d.T + pos[r][t]) * HD], HD, &dout[(b * n + t) * HD]);
    cpu::attention_delta(d.B, n, d.Hq, d.D, out.data(), dout.data(), delta.data());
    for (int64_t s = 0; s < cp; ++s) {
      if (cpu::causal_entries(pos[r].data(), n, pos[s].data(), n) == 0) continue;
      const float* kv = local[s].data();
      float* dkv = grad[s].data();
      cpu::attention_block_backward(bs, local[r].data(), kv + d.Hq * d.D, kv + (d.Hq + d.Hkv) * d.D,
                                    pos[r].data(), pos[s].data(), lse.data(), delta.data(),
                                    dout.data(), grad[r].data(), dkv + d.Hq * d.D,
                                    dkv + (d.Hq + d.Hkv) * d.D);
    }
  }
  // q and k/v parts of grad[r] were written by different blocks, but they are disjoint columns.
  for (int64_t r = 0; r < cp; ++r)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t t = 0; t < n; ++t)
        std::copy_n(&grad[r][(b * n + t) * S], S, &res.dqkv[(b * d.T + pos[r][t]) * S]);
  return res;
}

TEST(AttentionBlock, RingForwardMatchesFullCausalAttention) {
  for (int64_t cp : {1, 2, 3, 4}) {
    const Dims d{2, 2 * cp * 5, 6, 2, 7};  // chunks of 5, D=7: no size is a vector multiple
    const auto qkv = test::randn(size_t(d.B * d.T * d.stride()), 11 + cp);
    std::vector<double> ro, rl;
    naive(d, test::to_double(qkv), ro, rl);
    const auto res = ring(d, cp, qkv, nullptr);
    // fp32 dot products of length 7 and a softmax over <= 40 keys: ~1e-7 relative; 1e-5 leaves
    // room, while a wrong mask or merge weight is off by O(1e-1).
    EXPECT_LT(test::rel_l2(res.out, ro), 1e-5) << "cp=" << cp;
    EXPECT_LT(test::max_abs_diff(res.lse, rl), 1e-5) << "cp=" << cp;
    // With the zigzag layout every rank pair has causal entries (rank r's late chunk
    // 2cp-1-r >= cp sees some of every rank's keys), so no whole block is skipped; the masked
    // chunk pairs inside a block are skipped entry by entry in the kernel (no dot product).
    EXPECT_EQ(res.skipped, 0) << "cp=" << cp;
  }
}

TEST(AttentionBlock, FullyMaskedBlockIsNeutralInMerge) {
  const Dims d{1, 8, 2, 1, 3};
  const auto qkv = test::randn(size_t(d.B * d.T * d.stride()), 5);
  const std::vector<int64_t> qp{0, 1, 2, 3}, kp{4, 5, 6, 7};
  const auto bs = shape(d, 4, 4);
  std::vector<float> o(4 * 2 * 3, 1.0f), l(8, 0.0f);
  cpu::attention_block_forward(bs, qkv.data(), qkv.data() + 2 * 3, qkv.data() + 3 * 3, qp.data(),
                               kp.data(), o.data(), l.data());
  for (float x : l) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  for (float x : o) EXPECT_EQ(x, 0.0f);
  EXPECT_EQ(cpu::causal_entries(qp.data(), 4, kp.data(), 4), 0);
  std::vector<float> oa = test::randn(o.size(), 6), la = test::randn(l.size(), 7);
  const auto oa0 = oa, la0 = la;
  cpu::attention_merge(1, 4, 2, 3, oa.data(), la.data(), o.data(), l.data());
  EXPECT_EQ(oa, oa0);
  EXPECT_EQ(la, la0);
}

TEST(AttentionBlock, RingBackwardMatchesFiniteDifferences) {
  for (int64_t cp : {2, 3}) {
    const Dims d{2, 2 * cp * 2, 4, 2, 3};
    const auto qkv = test::randn(size_t(d.B * d.T * d.stride()), 21 + cp);
    const auto w = test::randn(size_t(d.B * d.T * d.Hq * d.D), 31 + cp);
    // loss = sum(out * w), so dout = w.
    const auto res = ring(d, cp, qkv, &w);
    const auto num = test::numeric_grad(
        [&](const std::vector<double>& x) {
          std::vector<double> o, l;
          naive(d, x, o, l);
          double f = 0;
          for (size_t i = 0; i < o.size(); ++i) f += o[i] * w[i];
          return f;
        },
        test::to_double(qkv));
    // fp32 kernel vs exact fp64 gradient (fd error ~1e-9): expect ~1e-6; a missing Di term or a
    // dk sent to the wrong rank is O(1).
    EXPECT_LT(test::rel_l2(res.dqkv, num), 2e-5) << "cp=" << cp;
    // Every rank's q, k and v got a gradient (none left at zero by a skipped accumulation).
    for (size_t i = 0; i < num.size(); ++i)
      if (std::abs(num[i]) > 1e-3) {
        ASSERT_NE(res.dqkv[i], 0.0f) << i;
      }
  }
}

// Load balance: the causal score entries each cp rank computes (its queries against all keys)
// are equal within 1% (the zigzag layout makes them exactly equal).
TEST(AttentionBlock, CpRanksComputeEqualAttentionWork) {
  for (int64_t cp : {2, 4, 8})
    for (int64_t T : {256, 1024, 4096}) {
      std::vector<std::vector<int64_t>> pos;
      for (int64_t r = 0; r < cp; ++r) pos.push_back(cpu::cp_positions(T, cp, r));
      const int64_t n = T / cp;
      int64_t lo = INT64_MAX, hi = 0, total = 0;
      for (int64_t r = 0; r < cp; ++r) {
        int64_t w = 0;
        for (int64_t s = 0; s < cp; ++s)
          w += cpu::causal_entries(pos[r].data(), n, pos[s].data(), n);
        lo = std::min(lo, w);
        hi = std::max(hi, w);
        total += w;
      }
      EXPECT_EQ(total, T * (T + 1) / 2) << "cp=" << cp << " T=" << T;
      EXPECT_LE(double(hi - lo), 0.01 * double(hi)) << "cp=" << cp << " T=" << T;
    }
  // The naive layout (rank r holds the r-th contiguous T/cp tokens) fails this check: the test
  // can tell a balanced layout from an unbalanced one.
  const int64_t T = 1024, cp = 4, n = T / cp;
  std::vector<int64_t> first(n), last(n), all(T);
  for (int64_t t = 0; t < n; ++t) first[t] = t, last[t] = T - n + t;
  for (int64_t t = 0; t < T; ++t) all[t] = t;
  EXPECT_GT(cpu::causal_entries(last.data(), n, all.data(), T),
            2 * cpu::causal_entries(first.data(), n, all.data(), T));
}

TEST(AttentionBlock, SequenceNotDivisibleIsAnError) {
  test::expect_error([] { cpu::cp_positions(30, 4, 0); }, {"30", "2*cp", "8"});
  test::expect_error([] { cpu::cp_positions(24, 2, 1, 4); }, {"24", "2*cp*tp", "16"});
  EXPECT_EQ(cpu::cp_positions(8, 2, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(cpu::cp_positions(8, 2, 0), (std::vector<int64_t>{0, 1, 6, 7}));
}

}  // namespace
}  // namespace loom
