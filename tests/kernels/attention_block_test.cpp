// Block attention with global positions (the kernel of ring attention): each simulated cp rank's
// queries against every rank's keys, merged by lse, must equal plain causal attention over the
// whole sequence (fp64 reference); the summed block backward must equal fp64 finite differences.
// Single blocks (tiled kernels: several 64-wide tiles, zigzag and unsorted positions, empty rows)
// against a naive fp64 block reference, thread-count determinism and the progress hook.
#include "kernels/cpu/attention_block.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <thread>

#include "tests/test_util.hpp"

namespace loom {
namespace {

using cpu::BlockShape;

// The zigzag layout of context parallelism (parallel/layers/context_parallel.hpp, a layer above
// the kernels): rank r holds chunks r and 2*cp-1-r of the 2*cp chunks of T.
std::vector<int64_t> zigzag_positions(int64_t T, int64_t cp, int64_t rank) {
  const int64_t c = T / (2 * cp);
  std::vector<int64_t> pos;
  for (int64_t chunk : {rank, 2 * cp - 1 - rank})
    for (int64_t t = 0; t < c; ++t) pos.push_back(chunk * c + t);
  return pos;
}

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
    pos[r] = zigzag_positions(d.T, cp, r);
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
    test::for_each_isa([&](cpu::Isa) {
      const auto res = ring(d, cp, qkv, nullptr);
      // fp32 dot products of length 7 and a softmax over <= 40 keys: ~1e-7 relative; 1e-5 leaves
      // room, while a wrong mask or merge weight is off by O(1e-1).
      EXPECT_LT(test::rel_l2(res.out, ro), 1e-5) << "cp=" << cp;
      EXPECT_LT(test::max_abs_diff(res.lse, rl), 1e-5) << "cp=" << cp;
      // With the zigzag layout every rank pair has causal entries (rank r's late chunk
      // 2cp-1-r >= cp sees some of every rank's keys), so no whole block is skipped; the masked
      // chunk pairs inside a block are skipped entry by entry in the kernel (no dot product).
      EXPECT_EQ(res.skipped, 0) << "cp=" << cp;
    });
  }
}

TEST_ALL_ISAS(AttentionBlock, FullyMaskedBlockIsNeutralInMerge) {
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
    const auto num = test::numeric_grad(
        [&](const std::vector<double>& x) {
          std::vector<double> o, l;
          naive(d, x, o, l);
          double f = 0;
          for (size_t i = 0; i < o.size(); ++i) f += o[i] * w[i];
          return f;
        },
        test::to_double(qkv));
    test::for_each_isa([&](cpu::Isa) {
      // loss = sum(out * w), so dout = w.
      const auto res = ring(d, cp, qkv, &w);
      // fp32 kernel vs exact fp64 gradient (fd error ~1e-9): expect ~1e-6; a missing Di term or a
      // dk sent to the wrong rank is O(1).
      EXPECT_LT(test::rel_l2(res.dqkv, num), 2e-5) << "cp=" << cp;
      // Every rank's q, k and v got a gradient (none left at zero by a skipped accumulation).
      for (size_t i = 0; i < num.size(); ++i)
        if (std::abs(num[i]) > 1e-3) {
          ASSERT_NE(res.dqkv[i], 0.0f) << i;
        }
    });
  }
}

// ---- single blocks against a naive fp64 block reference -------------------------------------

constexpr double kInf = std::numeric_limits<double>::infinity();

// A block as the model lays it out: q inside fused qkv rows (q_stride > Hq*D), k and v packed
// side by side in the travelling kv buffer.
struct Block {
  int64_t B, Hq, Hkv, D;
  std::vector<int64_t> qp, kp;
  std::string name;

  int64_t Tq() const { return int64_t(qp.size()); }
  int64_t Tk() const { return int64_t(kp.size()); }
  int64_t qs() const { return (Hq + 2 * Hkv) * D; }
  int64_t kvs() const { return 2 * Hkv * D; }
  BlockShape shape() const {
    return {B, Tq(), Tk(), Hq, Hkv, D, qs(), kvs(), float(1.0 / std::sqrt(double(D)))};
  }
  size_t q_size() const { return size_t(B * Tq() * qs()); }
  size_t kv_size() const { return size_t(B * Tk() * kvs()); }
  size_t out_size() const { return size_t(B * Tq() * Hq * D); }
  size_t lse_size() const { return size_t(B * Hq * Tq()); }
  size_t q_at(int64_t b, int64_t t, int64_t h) const {
    return size_t((b * Tq() + t) * qs() + h * D);
  }
  size_t k_at(int64_t b, int64_t t, int64_t g) const {
    return size_t((b * Tk() + t) * kvs() + g * D);
  }
  size_t v_at(int64_t b, int64_t t, int64_t g) const { return k_at(b, t, g) + size_t(Hkv * D); }
  size_t o_at(int64_t b, int64_t t, int64_t h) const {
    return size_t(((b * Tq() + t) * Hq + h) * D);
  }
  size_t l_at(int64_t b, int64_t h, int64_t t) const { return size_t((b * Hq + h) * Tq() + t); }
};

template <class T>
double dot_d(const T* a, const T* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// out/lse of the block in fp64 (rows that see no key: out 0, lse -inf).
template <class T>
void block_forward_ref(const Block& c, const std::vector<T>& q, const std::vector<T>& kv,
                       std::vector<double>& out, std::vector<double>& lse) {
  const double scale = 1.0 / std::sqrt(double(c.D));
  out.assign(c.out_size(), 0.0);
  lse.assign(c.lse_size(), -kInf);
  std::vector<double> s(static_cast<size_t>(c.Tk()));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Tq(); ++i) {
        const int64_t g = h / (c.Hq / c.Hkv);
        double m = -kInf;
        for (int64_t j = 0; j < c.Tk(); ++j) {
          s[j] = c.kp[j] <= c.qp[i] ? dot_d(&q[c.q_at(b, i, h)], &kv[c.k_at(b, j, g)], c.D) * scale
                                    : -kInf;
          m = std::max(m, s[j]);
        }
        if (m == -kInf) continue;
        double sum = 0;
        for (int64_t j = 0; j < c.Tk(); ++j) sum += s[j] == -kInf ? 0.0 : std::exp(s[j] - m);
        for (int64_t j = 0; j < c.Tk(); ++j) {
          if (s[j] == -kInf) continue;
          const double p = std::exp(s[j] - m) / sum;
          for (int64_t e = 0; e < c.D; ++e) out[c.o_at(b, i, h) + e] += p * kv[c.v_at(b, j, g) + e];
        }
        lse[c.l_at(b, h, i)] = m + std::log(sum);
      }
}

// This block's contributions to dq, dk, dv given the final lse and delta of the query rows
// (p = exp(s - lse), ds = p (dO.v - delta) scale), in fp64; dq in q's layout, dkv in kv's.
void block_backward_ref(const Block& c, const std::vector<float>& q, const std::vector<float>& kv,
                        const std::vector<float>& lse, const std::vector<float>& delta,
                        const std::vector<float>& dout, std::vector<double>& dq,
                        std::vector<double>& dkv) {
  const double scale = 1.0 / std::sqrt(double(c.D));
  dq.assign(c.q_size(), 0.0);
  dkv.assign(c.kv_size(), 0.0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Tq(); ++i) {
        const int64_t g = h / (c.Hq / c.Hkv);
        const double l = lse[c.l_at(b, h, i)], di = delta[c.l_at(b, h, i)];
        if (l == -kInf) continue;
        const float* qi = &q[c.q_at(b, i, h)];
        const float* doi = &dout[c.o_at(b, i, h)];
        for (int64_t j = 0; j < c.Tk(); ++j) {
          if (c.kp[j] > c.qp[i]) continue;
          const float* kj = &kv[c.k_at(b, j, g)];
          const float* vj = &kv[c.v_at(b, j, g)];
          const double p = std::exp(dot_d(qi, kj, c.D) * scale - l);
          const double ds = p * (dot_d(doi, vj, c.D) - di) * scale;
          for (int64_t e = 0; e < c.D; ++e) {
            dq[c.q_at(b, i, h) + e] += ds * kj[e];
            dkv[c.k_at(b, j, g) + e] += ds * qi[e];
            dkv[c.v_at(b, j, g) + e] += p * doi[e];
          }
        }
      }
}

std::vector<int64_t> zigzag(int64_t cp, int64_t rank, int64_t chunk) {
  return zigzag_positions(2 * cp * chunk, cp, rank);
}
std::vector<int64_t> random_positions(int64_t n, int64_t lo, int64_t hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> u(lo, hi - 1);
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (auto& x : p) x = u(rng);  // unsorted, with repeats (equal positions are visible)
  return p;
}
std::vector<int64_t> range(int64_t lo, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = lo + i;
  return p;
}

// Position layouts for B=2, Hq=4, Hkv=2 and head dim D.
std::vector<Block> cases(int64_t D) {
  std::vector<Block> v;
  const auto add = [&](std::vector<int64_t> qp, std::vector<int64_t> kp, std::string name) {
    v.push_back({2, 4, 2, D, std::move(qp), std::move(kp), name + " D=" + std::to_string(D)});
  };
  // Zigzag blocks: chunks of 37, 65 and 50 tokens, so tiles straddle the two chunks of a rank.
  add(zigzag(2, 0, 37), zigzag(2, 0, 37), "zigzag cp2 chunk37 q0 k0");
  add(zigzag(2, 0, 37), zigzag(2, 1, 37), "zigzag cp2 chunk37 q0 k1");
  add(zigzag(2, 1, 37), zigzag(2, 0, 37), "zigzag cp2 chunk37 q1 k0");
  add(zigzag(3, 1, 65), zigzag(3, 2, 65), "zigzag cp3 chunk65 q1 k2");
  add(zigzag(3, 2, 65), zigzag(3, 2, 65), "zigzag cp3 chunk65 q2 k2");
  add(zigzag(4, 3, 25), zigzag(4, 0, 25), "zigzag cp4 chunk25 q3 k0");
  add(zigzag(4, 0, 25), zigzag(4, 3, 25), "zigzag cp4 chunk25 q0 k3");
  // Unsorted positions with repeats, awkward lengths (1, 37, 64, 65, 130, 200).
  add(random_positions(37, 0, 300, 1), random_positions(200, 0, 300, 2), "random 37x200");
  add(random_positions(130, 0, 300, 3), random_positions(65, 0, 300, 4), "random 130x65");
  add(random_positions(64, 0, 100, 5), random_positions(64, 0, 100, 6), "random 64x64");
  add(random_positions(1, 150, 151, 7), random_positions(65, 0, 300, 8), "random 1x65");
  add(random_positions(200, 0, 300, 9), random_positions(1, 100, 101, 10), "random 200x1");
  // Queries below 120 see no key (lse -inf, out 0), in tiles mixed with queries that do.
  add(random_positions(130, 0, 400, 11), random_positions(65, 120, 400, 12), "some rows empty");
  add(range(0, 200), range(0, 200), "causal self 200");
  add(range(300, 65), random_positions(130, 0, 300, 13), "fully visible");
  add(range(0, 65), range(65, 37), "fully masked");
  return v;
}

struct BlockData {
  std::vector<float> q, kv, dout, lse, delta, dq0, dkv0;
};

// Random inputs; lse/delta of the backward as if other blocks also contributed (final lse >= this
// block's, random delta), and some rows with no key here still seeing keys elsewhere.
BlockData make_data(const Block& c, uint64_t seed) {
  BlockData d;
  d.q = test::randn(c.q_size(), seed);
  d.kv = test::randn(c.kv_size(), seed + 1);
  d.dout = test::randn(c.out_size(), seed + 2);
  std::vector<double> out, lse;
  block_forward_ref(c, d.q, d.kv, out, lse);
  const auto off = test::randn(lse.size(), seed + 3, 0.5f);
  d.lse.resize(lse.size());
  for (size_t i = 0; i < lse.size(); ++i)
    d.lse[i] = lse[i] == -kInf ? (i % 2 ? 1.5f : -INFINITY) : float(lse[i] + std::abs(off[i]));
  d.delta = test::randn(lse.size(), seed + 4, 0.5f);
  d.dq0 = test::randn(c.q_size(), seed + 5);
  d.dkv0 = test::randn(c.kv_size(), seed + 6);
  return d;
}

void run_forward(const Block& c, const BlockData& d, std::vector<float>& out,
                 std::vector<float>& lse, const std::function<void()>& progress = {}) {
  out.assign(c.out_size(), 7.0f);  // garbage: every element must be written
  lse.assign(c.lse_size(), 7.0f);
  cpu::attention_block_forward(c.shape(), d.q.data(), d.kv.data(), d.kv.data() + c.Hkv * c.D,
                               c.qp.data(), c.kp.data(), out.data(), lse.data(), progress);
}

void run_backward(const Block& c, const BlockData& d, std::vector<float>& dq,
                  std::vector<float>& dkv, const std::function<void()>& progress = {}) {
  dq = d.dq0;
  dkv = d.dkv0;
  cpu::attention_block_backward(c.shape(), d.q.data(), d.kv.data(), d.kv.data() + c.Hkv * c.D,
                                c.qp.data(), c.kp.data(), d.lse.data(), d.delta.data(),
                                d.dout.data(), dq.data(), dkv.data(), dkv.data() + c.Hkv * c.D,
                                progress);
}

// What the backward added onto the initial values.
std::vector<double> added(const std::vector<float>& now, const std::vector<float>& before) {
  std::vector<double> a(now.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = double(now[i]) - double(before[i]);
  return a;
}

TEST(AttentionBlock, ForwardMatchesNaiveBlock) {
  // Vectors per head dim on AVX-512 / AVX2 / baseline: 16 -> 1/2/4, 24 -> -/3/6, 48 -> 3/6/12,
  // 64 -> 4/8/16, 128 -> 8/16/32; 20 takes the generic path everywhere.
  for (int64_t D : {16, 24, 48, 64, 128, 20}) {
    uint64_t seed = 100;
    for (const Block& c : cases(D)) {
      const BlockData d = make_data(c, seed += 10);
      std::vector<double> ro, rl;
      block_forward_ref(c, d.q, d.kv, ro, rl);
      test::for_each_isa([&](cpu::Isa) {
        std::vector<float> out, lse;
        run_forward(c, d, out, lse);
        // fp32 dot products of length <= 64 and exp2 within 1 ulp, over <= 200 keys: errors
        // ~1e-6 on outputs that are convex combinations of N(0,1) values; 2e-5 leaves room, while a
        // wrong mask, a missed rescale or a wrong tile edge is off by >= 1e-2.
        int64_t empty = 0;
        for (size_t i = 0; i < rl.size(); ++i) {
          if (rl[i] == -kInf) {
            ++empty;
            ASSERT_EQ(lse[i], -INFINITY) << c.name << " row " << i;
          } else {
            ASSERT_NEAR(lse[i], rl[i], 2e-5) << c.name << " row " << i;
          }
        }
        for (float x : out) ASSERT_FALSE(std::isnan(x)) << c.name;
        EXPECT_LT(test::max_abs_diff(out, ro), 2e-5) << c.name;
        // Rows with no visible key are exactly zero (the merge relies on it).
        for (int64_t b = 0; b < c.B; ++b)
          for (int64_t h = 0; h < c.Hq; ++h)
            for (int64_t t = 0; t < c.Tq(); ++t)
              if (rl[c.l_at(b, h, t)] == -kInf) {
                for (int64_t e = 0; e < c.D; ++e) ASSERT_EQ(out[c.o_at(b, t, h) + e], 0.0f);
              }
        // The layouts do what their names say.
        if (c.name.rfind("fully masked", 0) == 0) {
          EXPECT_EQ(empty, int64_t(rl.size())) << c.name;
        }
        if (c.name.rfind("fully visible", 0) == 0 || c.name.rfind("causal", 0) == 0) {
          EXPECT_EQ(empty, 0) << c.name;
        }
        if (c.name.rfind("some rows empty", 0) == 0) {
          EXPECT_GT(empty, 0) << c.name;
          EXPECT_LT(empty, int64_t(rl.size())) << c.name;
        }
      });
    }
  }
}

TEST(AttentionBlock, BackwardMatchesNaiveBlock) {
  for (int64_t D : {16, 48, 64, 20}) {
    uint64_t seed = 500;
    for (const Block& c : cases(D)) {
      const BlockData d = make_data(c, seed += 10);
      std::vector<double> rdq, rdkv;
      block_backward_ref(c, d.q, d.kv, d.lse, d.delta, d.dout, rdq, rdkv);
      test::for_each_isa([&](cpu::Isa) {
        std::vector<float> dq, dkv;
        run_backward(c, d, dq, dkv);
        for (float x : dq) ASSERT_FALSE(std::isnan(x)) << c.name;
        for (float x : dkv) ASSERT_FALSE(std::isnan(x)) << c.name;
        if (c.name.rfind("fully masked", 0) == 0) {
          // Nothing visible: the accumulators are untouched, bit for bit.
          EXPECT_EQ(dq, d.dq0) << c.name;
          EXPECT_EQ(dkv, d.dkv0) << c.name;
          return;
        }
        // The kernel adds onto non-zero initial values (subtracting them back costs ~1e-7
        // absolute). fp32 products over <= 200 terms: ~1e-6 relative; 2e-5 catches a wrong mask
        // entry, a dropped delta or a missing scale (>= 1e-2), and overwriting instead of adding
        // (O(1)).
        EXPECT_LT(test::rel_l2(added(dq, d.dq0), rdq), 2e-5) << c.name;
        EXPECT_LT(test::rel_l2(added(dkv, d.dkv0), rdkv), 2e-5) << c.name;
      });
    }
  }
}

// The kernel's gradient (dq, dk, dv of loss = sum(out * w) for the block alone, whose final lse
// is its own) against fp64 central differences of the naive block forward, on a subset of the
// coordinates: two query and two key tiles, unsorted positions, some rows seeing no key, and
// the generic head-dim path.
TEST(AttentionBlock, BackwardMatchesFiniteDifferences) {
  const Block c{1,   2, 1, 20, random_positions(70, 0, 120, 41), random_positions(67, 30, 150, 42),
                "fd"};
  BlockData d0;
  d0.q = test::randn(c.q_size(), 43);
  d0.kv = test::randn(c.kv_size(), 44);
  d0.dout = test::randn(c.out_size(), 45);  // w
  d0.dq0.assign(c.q_size(), 0.0f);
  d0.dkv0.assign(c.kv_size(), 0.0f);

  // Coordinates: every 7th of q and of kv (q's own columns and the k and v halves).
  std::vector<std::pair<bool, size_t>> at;  // (is q, index)
  for (size_t i = 0; i < c.q_size(); i += 7)
    if (int64_t(i) % c.qs() < c.Hq * c.D) at.push_back({true, i});
  for (size_t i = 3; i < c.kv_size(); i += 7) at.push_back({false, i});
  std::vector<double> x0(at.size());
  for (size_t n = 0; n < at.size(); ++n)
    x0[n] = at[n].first ? d0.q[at[n].second] : d0.kv[at[n].second];
  const auto num = test::numeric_grad(
      [&](const std::vector<double>& x) {
        auto q = test::to_double(d0.q), kv = test::to_double(d0.kv);
        for (size_t n = 0; n < at.size(); ++n) (at[n].first ? q : kv)[at[n].second] = x[n];
        std::vector<double> o, l;
        block_forward_ref(c, q, kv, o, l);
        double f = 0;
        for (size_t i = 0; i < o.size(); ++i) f += o[i] * d0.dout[i];
        return f;
      },
      x0);

  test::for_each_isa([&](cpu::Isa) {
    BlockData d = d0;
    std::vector<float> out, lse;
    run_forward(c, d, out, lse);
    d.lse = lse;
    d.delta.resize(lse.size());
    cpu::attention_delta(c.B, c.Tq(), c.Hq, c.D, out.data(), d.dout.data(), d.delta.data());
    std::vector<float> dq, dkv;
    run_backward(c, d, dq, dkv);
    EXPECT_GT(std::count(lse.begin(), lse.end(), -INFINITY), 0);
    std::vector<double> kernel(at.size());
    for (size_t n = 0; n < at.size(); ++n)
      kernel[n] = at[n].first ? dq[at[n].second] : dkv[at[n].second];
    // fp32 kernel against the fp64 derivative (central-difference error ~1e-9): ~1e-6 relative;
    // a sign, scale or mask error is O(1e-1).
    EXPECT_LT(test::rel_l2(kernel, num), 2e-5);
  });
}

// Bit-identical results with 1 and 2 threads. B=1, Hkv=1: one (batch, kv group) unit, so two
// threads run the backward's split scheme and one thread its fused scheme; B=2, Hkv=2: both fused.
TEST_ALL_ISAS(AttentionBlock, ResultsDoNotDependOnThreadCount) {
  const int threads = omp_get_max_threads();
  for (const auto& [B, Hkv] : {std::pair<int64_t, int64_t>{1, 1}, {2, 2}}) {
    const Block c{B, 4, Hkv, 48, zigzag(3, 1, 70), zigzag(3, 2, 70), "threads"};
    const BlockData d = make_data(c, 77);
    std::vector<float> out[2], lse[2], dq[2], dkv[2];
    for (int n : {1, 2}) {
      omp_set_num_threads(n);
      run_forward(c, d, out[n - 1], lse[n - 1]);
      run_backward(c, d, dq[n - 1], dkv[n - 1]);
    }
    omp_set_num_threads(threads);
    EXPECT_EQ(out[0], out[1]) << "B=" << B << " Hkv=" << Hkv;
    EXPECT_EQ(lse[0], lse[1]) << "B=" << B << " Hkv=" << Hkv;
    EXPECT_EQ(dq[0], dq[1]) << "B=" << B << " Hkv=" << Hkv;
    EXPECT_EQ(dkv[0], dkv[1]) << "B=" << B << " Hkv=" << Hkv;
    EXPECT_NE(dq[0], d.dq0);  // the comparison is not between untouched buffers
  }
}

// The progress hook runs on the calling thread only (OpenMP thread 0), never two at a time, and
// changes nothing in the results. With one thread, every unit ends with a call, so there are
// more calls than the one on entry (with two, thread 0 may find every unit taken).
TEST(AttentionBlock, ProgressHookIsCalledOnTheCallingThread) {
  const int threads = omp_get_max_threads();
  for (int n : {1, 2})
    for (const auto& [B, Hkv] : {std::pair<int64_t, int64_t>{1, 1}, {2, 2}}) {
      omp_set_num_threads(n);
      const Block c{B, 4, Hkv, 64, zigzag(2, 0, 100), zigzag(2, 1, 100), "progress"};
      const BlockData d = make_data(c, 88);
      const auto caller = std::this_thread::get_id();
      std::atomic<int> calls{0}, inside{0}, wrong{0};
      const std::function<void()> hook = [&] {
        if (inside.fetch_add(1) != 0 || std::this_thread::get_id() != caller) ++wrong;
        ++calls;
        inside.fetch_sub(1);
      };
      std::vector<float> out, lse, out_h, lse_h, dq, dkv, dq_h, dkv_h;
      run_forward(c, d, out, lse);
      run_forward(c, d, out_h, lse_h, hook);
      const int fwd_calls = calls.load();
      run_backward(c, d, dq, dkv);
      run_backward(c, d, dq_h, dkv_h, hook);
      const int bwd_calls = calls.load() - fwd_calls;
      omp_set_num_threads(threads);
      const std::string what = "threads=" + std::to_string(n) + " B=" + std::to_string(B);
      EXPECT_GT(fwd_calls, n == 1 ? 1 : 0) << what;
      EXPECT_GT(bwd_calls, n == 1 ? 1 : 0) << what;
      EXPECT_EQ(wrong.load(), 0) << what;
      EXPECT_EQ(out, out_h) << what;
      EXPECT_EQ(lse, lse_h) << what;
      EXPECT_EQ(dq, dq_h) << what;
      EXPECT_EQ(dkv, dkv_h) << what;
    }
}

TEST(AttentionBlock, BadShapeIsAnError) {
  const Block c{1, 3, 2, 16, range(0, 4), range(0, 4), "bad"};
  const BlockData d = make_data({1, 2, 1, 16, range(0, 4), range(0, 4), "ok"}, 1);
  std::vector<float> out(64), lse(16);
  test::expect_error(
      [&] {
        cpu::attention_block_forward(c.shape(), d.q.data(), d.kv.data(), d.kv.data(), c.qp.data(),
                                     c.kp.data(), out.data(), lse.data());
      },
      {"attention_block_forward", "Hq (3)", "multiple of Hkv (2)"});
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// tiled_entries counts by sorted key tiles and a binary search: against the pairwise count of
// every (query tile, key tile) on shuffled, sorted, zigzag (context parallel's chunks) and ragged
// positions, and the causal count as its lower bound.
TEST(AttentionBlock, TiledEntriesEqualsThePairwiseCount) {
  const auto pairwise = [](const std::vector<int64_t>& q, const std::vector<int64_t>& k) {
    int64_t n = 0;
    for (size_t i = 0; i < q.size(); i += size_t(cpu::kAttentionTile)) {
      const size_t qe = std::min(q.size(), i + size_t(cpu::kAttentionTile));
      const int64_t qhi = *std::max_element(q.begin() + long(i), q.begin() + long(qe));
      for (size_t j = 0; j < k.size(); j += size_t(cpu::kAttentionTile)) {
        const size_t ke = std::min(k.size(), j + size_t(cpu::kAttentionTile));
        const int64_t klo = *std::min_element(k.begin() + long(j), k.begin() + long(ke));
        if (klo <= qhi) n += int64_t((qe - i) * (ke - j));
      }
    }
    return n;
  };
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t Tq = 1 + int64_t(rng() % 700), Tk = 1 + int64_t(rng() % 700);
    std::vector<int64_t> q(static_cast<size_t>(Tq)), k(static_cast<size_t>(Tk));
    for (int64_t i = 0; i < Tq; ++i) q[size_t(i)] = i + (trial % 3 == 0 ? 0 : int64_t(rng() % 500));
    for (int64_t i = 0; i < Tk; ++i) k[size_t(i)] = i + (trial % 4 == 0 ? 300 : 0);
    if (trial % 2) std::shuffle(k.begin(), k.end(), rng);
    if (trial % 5 == 1) std::shuffle(q.begin(), q.end(), rng);
    const int64_t n = cpu::tiled_entries(q.data(), Tq, k.data(), Tk);
    EXPECT_EQ(n, pairwise(q, k)) << "trial " << trial;
    EXPECT_GE(n, cpu::causal_entries(q.data(), Tq, k.data(), Tk)) << "trial " << trial;
  }
  // Context parallel 2's zigzag: rank 0 holds chunks 0 and 3 of four.
  std::vector<int64_t> zig;
  for (int64_t i = 0; i < 200; ++i) zig.push_back(i);
  for (int64_t i = 600; i < 800; ++i) zig.push_back(i);
  EXPECT_EQ(cpu::tiled_entries(zig.data(), 400, zig.data(), 400), pairwise(zig, zig));
}

}  // namespace
}  // namespace loom
