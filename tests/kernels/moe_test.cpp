// kernels/cpu/moe.hpp: the router against an fp64 softmax and a reference top-k, its backward
// against fp64 finite differences, the permutation against a naive grouping (with capacity
// drops), gather and weighted sum against naive loops, bf16 variants, thread-count determinism
// and the kernels' index checks.
#include "kernels/cpu/moe.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::test::same_bits;
using loom::test::to_bf16;
using loom::test::widen;
using loom::test::with_threads;

namespace {

// Each token's k distinct experts, drawn with a skew (expert e about twice as likely as e + 1;
// the last expert never) so that some experts get many rows, some few, one none.
std::vector<int32_t> random_experts(int64_t M, int64_t k, int64_t E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> wts(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) wts[size_t(e)] = e + 1 < E ? std::pow(0.5, double(e)) : 0.0;
  std::vector<int32_t> out;
  for (int64_t t = 0; t < M; ++t) {
    std::vector<double> w = wts;
    for (int64_t j = 0; j < k; ++j) {
      std::discrete_distribution<int> d(w.begin(), w.end());
      const int e = d(rng);
      out.push_back(int32_t(e));
      w[size_t(e)] = 0;
    }
  }
  return out;
}

// The fp64 softmax of one row.
std::vector<double> softmax(const double* x, int64_t E) {
  double m = x[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, x[e]);
  std::vector<double> p(static_cast<size_t>(E));
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += p[size_t(e)] = std::exp(x[e] - m);
  for (double& v : p) v /= s;
  return p;
}

// The permutation of random (skewed) choices.
struct Perm {
  std::vector<int32_t> experts, pos, order;
  std::vector<int64_t> counts;
  int64_t N = 0, dropped = 0;
};
Perm permute(int64_t M, int64_t k, int64_t E, int64_t capacity, uint64_t seed) {
  Perm p;
  p.experts = random_experts(M, k, E, seed);
  p.pos.resize(size_t(M * k));
  p.counts.resize(size_t(E));
  p.dropped = cpu::moe_permute(p.experts.data(), M, k, E, capacity, p.counts.data(), p.pos.data());
  p.N = std::accumulate(p.counts.begin(), p.counts.end(), int64_t{0});
  p.order.resize(size_t(p.N));
  cpu::moe_permute_order(p.pos.data(), M * k, p.N, p.order.data());
  return p;
}

}  // namespace

// probs against the fp64 softmax (3e-6 relative: the f32 x - max rounds by up to 5e-7 absolute
// for these logits, then the f32 exp), experts
// against a stable sort of the fp64 scores (random logits leave no near ties), weights against
// the fp64 chosen probs (renormalized or not), prob_sum against fp64 column sums added to its
// initial values.
TEST(Moe, RouteMatchesReference) {
  const int64_t M = 37, E = 16, k = 4;
  const auto logits = test::randn(size_t(M * E), 1, 2.0f);
  const auto bias_v = test::randn(size_t(E), 2, 0.05f);
  const auto sum0 = test::randn(size_t(E), 3);
  for (bool with_bias : {false, true}) {
    for (bool renorm : {false, true}) {
      SCOPED_TRACE(testing::Message() << "bias " << with_bias << " renormalize " << renorm);
      std::vector<float> probs(size_t(M * E)), weights(size_t(M * k)), prob_sum = sum0;
      std::vector<int32_t> experts(size_t(M * k));
      cpu::moe_route(logits.data(), with_bias ? bias_v.data() : nullptr, M, E, k, renorm,
                     probs.data(), experts.data(), weights.data(), prob_sum.data());
      std::vector<double> ref_sum(sum0.begin(), sum0.end());
      for (int64_t t = 0; t < M; ++t) {
        const auto x = test::to_double(std::vector<float>(&logits[t * E], &logits[(t + 1) * E]));
        const auto p = softmax(x.data(), E);
        for (int64_t e = 0; e < E; ++e) {
          ASSERT_NEAR(probs[t * E + e], p[size_t(e)], 3e-6 * p[size_t(e)]) << t << "," << e;
          ref_sum[size_t(e)] += p[size_t(e)];
        }
        std::vector<int> idx(static_cast<size_t>(E));
        std::iota(idx.begin(), idx.end(), 0);
        auto score = [&](int e) { return p[size_t(e)] + (with_bias ? bias_v[size_t(e)] : 0.0); };
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score(a) > score(b); });
        double s = 0;
        for (int64_t j = 0; j < k; ++j) s += p[size_t(idx[size_t(j)])];
        for (int64_t j = 0; j < k; ++j) {
          ASSERT_EQ(experts[t * k + j], idx[size_t(j)]) << "token " << t << " choice " << j;
          const double w = p[size_t(idx[size_t(j)])] / (renorm ? s : 1.0);
          EXPECT_NEAR(weights[t * k + j], w, 5e-6 * w) << t << "," << j;
        }
      }
      for (int64_t e = 0; e < E; ++e)
        EXPECT_NEAR(prob_sum[size_t(e)], ref_sum[size_t(e)], 3e-6 * std::abs(ref_sum[size_t(e)]))
            << e;
      // In place (probs = logits) gives the same bits.
      std::vector<float> inplace = logits, w2(size_t(M * k));
      std::vector<int32_t> e2(size_t(M * k));
      cpu::moe_route(inplace.data(), with_bias ? bias_v.data() : nullptr, M, E, k, renorm,
                     inplace.data(), e2.data(), w2.data(), nullptr);
      EXPECT_TRUE(same_bits(inplace, probs));
      EXPECT_TRUE(same_bits(e2, experts));
      EXPECT_TRUE(same_bits(w2, weights));
    }
  }
}

// Equal probabilities: the lower expert index wins. The bias moves the choice but the weights are
// the probabilities alone.
TEST(Moe, RouteBreaksTiesToTheLowerIndexAndBiasSelectsOnly) {
  const int64_t E = 8, k = 3;
  std::vector<float> logits = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,  // all tied
                               1.0f, 3.0f, 0.0f, 3.0f, -1.f, 3.0f, 2.0f, 3.0f,  // four tied at 3
                               0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  const int64_t M = 3;
  std::vector<float> probs(size_t(M * E)), weights(size_t(M * k));
  std::vector<int32_t> experts(size_t(M * k));
  cpu::moe_route(logits.data(), nullptr, M, E, k, false, probs.data(), experts.data(),
                 weights.data(), nullptr);
  EXPECT_EQ(experts, (std::vector<int32_t>{0, 1, 2, 1, 3, 5, 0, 1, 2}));
  for (int64_t j = 0; j < k; ++j) EXPECT_EQ(weights[size_t(j)], 0.125f);

  // A bias on experts 5 and 7 puts them first; a negative one on expert 0 passes it over.
  std::vector<float> bias(size_t(E), 0.0f);
  bias[5] = 0.5f, bias[7] = 0.25f, bias[0] = -0.1f;
  cpu::moe_route(logits.data(), bias.data(), M, E, k, false, probs.data(), experts.data(),
                 weights.data(), nullptr);
  EXPECT_EQ(std::vector<int32_t>(experts.begin(), experts.begin() + k),
            (std::vector<int32_t>{5, 7, 1}));
  for (int64_t j = 0; j < k; ++j) EXPECT_EQ(weights[size_t(j)], 0.125f) << j;
  // Row 1: the bias lifts expert 5 and 7 above their tied peers 1 and 3.
  EXPECT_EQ(std::vector<int32_t>(experts.begin() + k, experts.begin() + 2 * k),
            (std::vector<int32_t>{5, 7, 1}));
  for (int64_t j = 0; j < k; ++j) EXPECT_EQ(weights[size_t(k + j)], probs[E + 1]) << j;
  cpu::moe_route(logits.data(), bias.data(), M, E, k, true, probs.data(), experts.data(),
                 weights.data(), nullptr);
  for (int64_t j = 0; j < k; ++j) EXPECT_FLOAT_EQ(weights[size_t(j)], 1.0f / 3) << j;
}

// L = sum_tj r_tj w_tj + sum_te dprob_e p_te with the choices held fixed: the kernel's dlogits
// against fp64 central differences of the fp64 router, with and without renormalization and
// dprob. The kernel's f32 probabilities make it agree to ~1e-7; 1e-5 leaves margin and still
// catches a dropped term of the renormalization or the softmax.
TEST(Moe, RouteBackwardMatchesFiniteDifferences) {
  const int64_t M = 6, E = 8, k = 3;
  const auto logits = test::randn(size_t(M * E), 4, 1.5f);
  const auto r = test::randn(size_t(M * k), 5);
  const auto dprob_v = test::randn(size_t(E), 6, 0.3f);
  for (bool renorm : {false, true}) {
    for (bool with_dprob : {false, true}) {
      SCOPED_TRACE(testing::Message() << "renormalize " << renorm << " dprob " << with_dprob);
      std::vector<float> probs(size_t(M * E)), weights(size_t(M * k));
      std::vector<int32_t> experts(size_t(M * k));
      cpu::moe_route(logits.data(), nullptr, M, E, k, renorm, probs.data(), experts.data(),
                     weights.data(), nullptr);
      const float* dprob = with_dprob ? dprob_v.data() : nullptr;
      std::vector<float> dlogits(size_t(M * E), std::nanf(""));
      cpu::moe_route_backward(probs.data(), experts.data(), weights.data(), r.data(), M, E, k,
                              renorm, dprob, dlogits.data());
      auto loss = [&](const std::vector<double>& x) {
        double L = 0;
        for (int64_t t = 0; t < M; ++t) {
          const auto p = softmax(&x[size_t(t * E)], E);
          double s = 0;
          for (int64_t j = 0; j < k; ++j) s += p[size_t(experts[t * k + j])];
          for (int64_t j = 0; j < k; ++j)
            L += r[t * k + j] * p[size_t(experts[t * k + j])] / (renorm ? s : 1.0);
          if (dprob)
            for (int64_t e = 0; e < E; ++e) L += dprob[e] * p[size_t(e)];
        }
        return L;
      };
      const auto num = test::numeric_grad(loss, test::to_double(logits));
      for (float v : dlogits) ASSERT_TRUE(std::isfinite(v));
      EXPECT_LT(test::rel_l2(dlogits, num), 1e-5);
      EXPECT_LT(test::max_abs_diff(dlogits, num), 1e-6);
      // In place (dlogits = probs).
      std::vector<float> inplace = probs;
      cpu::moe_route_backward(inplace.data(), experts.data(), weights.data(), r.data(), M, E, k,
                              renorm, dprob, inplace.data());
      EXPECT_TRUE(same_bits(inplace, dlogits));
    }
  }
}

// order lists each expert's assignments in increasing a = t*k + j, experts in order; pos is its
// inverse. A naive grouping gives the same.
TEST(Moe, PermuteIsAStableCountingSort) {
  const int64_t M = 50, k = 2, E = 8;
  const Perm p = permute(M, k, E, 0, 7);
  std::vector<int32_t> want_order;
  std::vector<int64_t> want_counts(size_t(E), 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t a = 0; a < M * k; ++a)
      if (p.experts[size_t(a)] == e) {
        want_order.push_back(int32_t(a));
        ++want_counts[size_t(e)];
      }
  EXPECT_EQ(p.dropped, 0);
  EXPECT_EQ(p.N, M * k);
  EXPECT_EQ(p.counts, want_counts);
  EXPECT_EQ(p.order, want_order);
  EXPECT_EQ(want_counts[E - 1], 0);  // an expert without rows
  for (int64_t i = 0; i < p.N; ++i) EXPECT_EQ(p.pos[size_t(p.order[size_t(i)])], i);
}

// capacity: each expert keeps its first `capacity` assignments in token order; the rest are
// dropped (pos -1) and counted.
TEST(Moe, PermuteDropsBeyondCapacityInTokenOrder) {
  const int64_t M = 40, k = 2, E = 6, capacity = 9;
  const Perm p = permute(M, k, E, capacity, 8);
  std::vector<int64_t> seen(size_t(E), 0), want_counts(size_t(E), 0);
  std::vector<int32_t> want_order;
  int64_t dropped = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t a = 0; a < M * k; ++a)
      if (p.experts[size_t(a)] == e && want_counts[size_t(e)] < capacity) {
        want_order.push_back(int32_t(a));
        ++want_counts[size_t(e)];
      }
  for (int64_t a = 0; a < M * k; ++a) {
    const int64_t e = p.experts[size_t(a)];
    const bool kept = seen[size_t(e)]++ < capacity;
    EXPECT_EQ(p.pos[size_t(a)] >= 0, kept) << "assignment " << a;
    dropped += !kept;
  }
  EXPECT_GT(dropped, 0) << "the skew should overflow expert 0";
  EXPECT_EQ(p.dropped, dropped);
  EXPECT_EQ(p.counts, want_counts);
  EXPECT_EQ(p.order, want_order);
  EXPECT_EQ(p.N + p.dropped, M * k);
  for (int64_t i = 0; i < p.N; ++i) EXPECT_EQ(p.pos[size_t(p.order[size_t(i)])], i);
}

// A capacity per expert (context parallelism's share of the micro-batch's): expert e keeps its
// first capacity[e] assignments in token order, each expert by its own; a scalar capacity is the
// same capacity for every expert.
TEST(Moe, PermuteKeepsEachExpertsOwnCapacity) {
  const int64_t M = 40, k = 2, E = 6;
  const std::vector<int32_t> experts = random_experts(M, k, E, 9);
  const std::vector<int64_t> capacity = {0, 3, 9, 1, 40, 5};
  const size_t n = static_cast<size_t>(E);
  std::vector<int64_t> counts(n), seen(n, 0), want_counts(n, 0);
  std::vector<int32_t> pos(size_t(M * k));
  const int64_t dropped = cpu::moe_permute_per_expert(experts.data(), M, k, E, capacity.data(),
                                                      counts.data(), pos.data());
  int64_t want_dropped = 0;
  std::vector<int64_t> start(n, 0);
  for (int64_t a = 0; a < M * k; ++a) {
    const size_t e = size_t(experts[size_t(a)]);
    if (seen[e]++ < capacity[e])
      ++want_counts[e];
    else
      ++want_dropped;
  }
  for (int64_t e = 1; e < E; ++e)
    start[size_t(e)] = start[size_t(e - 1)] + want_counts[size_t(e - 1)];
  std::fill(seen.begin(), seen.end(), 0);
  for (int64_t a = 0; a < M * k; ++a) {
    const size_t e = size_t(experts[size_t(a)]);
    const int64_t i = seen[e]++;
    EXPECT_EQ(pos[size_t(a)], i < capacity[e] ? int32_t(start[e] + i) : -1) << "assignment " << a;
  }
  EXPECT_EQ(counts, want_counts);
  EXPECT_EQ(dropped, want_dropped);
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(counts[0], 0);  // a capacity of 0 drops every row of that expert

  const std::vector<int64_t> nine(n, 9);
  std::vector<int64_t> c1(n), c2(n);
  std::vector<int32_t> p1(size_t(M * k)), p2(size_t(M * k));
  EXPECT_EQ(
      cpu::moe_permute(experts.data(), M, k, E, 9, c1.data(), p1.data()),
      cpu::moe_permute_per_expert(experts.data(), M, k, E, nine.data(), c2.data(), p2.data()));
  EXPECT_EQ(c1, c2);
  EXPECT_EQ(p1, p2);
  const std::vector<int64_t> negative = {1, 1, -1, 1, 1, 1};
  test::expect_error(
      [&] {
        cpu::moe_permute_per_expert(experts.data(), M, k, E, negative.data(), c1.data(), p1.data());
      },
      {"moe_permute", "expert 2", "capacity", "-1"});
}

// xs row i = x row order[i] / k, bit for bit, f32 and bf16.
TEST(Moe, DispatchGathersRows) {
  const int64_t M = 33, k = 3, E = 5, d = 19;
  const Perm p = permute(M, k, E, 0, 9);
  const auto x = test::randn(size_t(M * d), 10);
  std::vector<float> xs(size_t(p.N * d));
  cpu::moe_dispatch(x.data(), M, d, p.order.data(), p.N, k, xs.data());
  const auto x16 = to_bf16(x);
  std::vector<bf16> xs16(size_t(p.N * d));
  cpu::moe_dispatch(x16.data(), M, d, p.order.data(), p.N, k, xs16.data());
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t t = p.order[size_t(i)] / k;
    ASSERT_EQ(std::memcmp(&xs[size_t(i * d)], &x[size_t(t * d)], d * sizeof(float)), 0) << i;
    ASSERT_EQ(std::memcmp(&xs16[size_t(i * d)], &x16[size_t(t * d)], d * sizeof(bf16)), 0) << i;
  }
}

// The dispatch is linear, its backward the transpose: <dispatch(x), g> = <x, backward(g)> for
// random x and g, with and without drops; the backward also equals the sum of each token's rows
// in choice order (the same f32 additions), added to dx with accumulate.
TEST(Moe, DispatchBackwardIsTheTranspose) {
  const int64_t M = 29, k = 2, E = 4, d = 11;
  for (int64_t capacity : {0, 12}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    const Perm p = permute(M, k, E, capacity, 11);
    const auto x = test::randn(size_t(M * d), 12);
    const auto g = test::randn(size_t(p.N * d), 13);
    std::vector<float> xs(size_t(p.N * d));
    cpu::moe_dispatch(x.data(), M, d, p.order.data(), p.N, k, xs.data());
    std::vector<float> dx(size_t(M * d), std::nanf(""));
    cpu::moe_dispatch_backward(g.data(), p.N, p.pos.data(), M, k, d, dx.data(), false);
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < xs.size(); ++i) lhs += double(xs[i]) * g[i];
    for (size_t i = 0; i < x.size(); ++i) rhs += double(x[i]) * dx[i];
    EXPECT_NEAR(lhs, rhs, 1e-5 * std::abs(lhs));
    // The serial sum, and with accumulate the same additions after dx's values.
    const auto init = test::randn(size_t(M * d), 14);
    std::vector<float> want(size_t(M * d), 0.0f), want_acc = init;
    for (int64_t t = 0; t < M; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (const int32_t r = p.pos[size_t(t * k + j)]; r >= 0)
          for (int64_t c = 0; c < d; ++c) {
            want[size_t(t * d + c)] += g[size_t(r * d + c)];
            want_acc[size_t(t * d + c)] += g[size_t(r * d + c)];
          }
    EXPECT_TRUE(same_bits(dx, want));
    std::vector<float> acc = init;
    cpu::moe_dispatch_backward(g.data(), p.N, p.pos.data(), M, k, d, acc.data(), true);
    EXPECT_TRUE(same_bits(acc, want_acc));
  }
}

// y += the weighted sum of each token's kept rows, against fp64 (f32 products and sums: 1e-6);
// bf16 ys read widened: the bits of the f32 kernel on the widened rows.
TEST(Moe, CombineMatchesReference) {
  const int64_t M = 31, k = 3, E = 6, d = 23;
  for (int64_t capacity : {0, 10}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    const Perm p = permute(M, k, E, capacity, 15);
    const auto ys = test::randn(size_t(p.N * d), 16);
    const auto w = test::randn(size_t(M * k), 17);
    const auto y0 = test::randn(size_t(M * d), 18);
    std::vector<float> y = y0;
    cpu::moe_combine(ys.data(), p.N, w.data(), p.pos.data(), M, k, d, y.data());
    std::vector<double> ref(y0.begin(), y0.end());
    for (int64_t t = 0; t < M; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (const int32_t r = p.pos[size_t(t * k + j)]; r >= 0)
          for (int64_t c = 0; c < d; ++c)
            ref[size_t(t * d + c)] += double(w[size_t(t * k + j)]) * ys[size_t(r * d + c)];
    EXPECT_LT(test::rel_l2(y, ref), 1e-6);
    EXPECT_LT(test::max_abs_diff(y, ref), 1e-5);

    const auto ys16 = to_bf16(ys);
    const auto wide = widen(ys16);
    std::vector<float> y16 = y0, ywide = y0;
    cpu::moe_combine(ys16.data(), p.N, w.data(), p.pos.data(), M, k, d, y16.data());
    cpu::moe_combine(wide.data(), p.N, w.data(), p.pos.data(), M, k, d, ywide.data());
    EXPECT_TRUE(same_bits(y16, ywide));
  }
}

// L = sum_t r_t . y_t with y = combine(ys, w): dys and dweights against fp64 central differences
// over ys and w together (L is bilinear: the differences are exact to ~1e-10); dropped choices
// get a zero weight gradient. bf16: ys widened, dys rounded (the bits of the f32 kernel's).
TEST(Moe, CombineBackwardMatchesFiniteDifferences) {
  const int64_t M = 9, k = 2, E = 4, d = 5;
  for (int64_t capacity : {0, 3}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    const Perm p = permute(M, k, E, capacity, 19);
    const auto ys = test::randn(size_t(p.N * d), 20);
    const auto w = test::randn(size_t(M * k), 21);
    const auto r = test::randn(size_t(M * d), 22);
    std::vector<float> dys(size_t(p.N * d), std::nanf("")), dw(size_t(M * k), std::nanf(""));
    cpu::moe_combine_backward(r.data(), ys.data(), p.N, w.data(), p.pos.data(), M, k, d, dys.data(),
                              dw.data());
    std::vector<double> v = test::to_double(ys);
    v.insert(v.end(), w.begin(), w.end());
    const size_t nys = ys.size();
    auto loss = [&](const std::vector<double>& u) {
      double L = 0;
      for (int64_t t = 0; t < M; ++t)
        for (int64_t j = 0; j < k; ++j)
          if (const int32_t row = p.pos[size_t(t * k + j)]; row >= 0)
            for (int64_t c = 0; c < d; ++c)
              L += r[size_t(t * d + c)] * u[nys + size_t(t * k + j)] * u[size_t(row * d + c)];
      return L;
    };
    const auto num = test::numeric_grad(loss, v);
    const std::vector<double> num_ys(num.begin(), num.begin() + long(nys)),
        num_w(num.begin() + long(nys), num.end());
    for (float x : dys) ASSERT_TRUE(std::isfinite(x));
    EXPECT_LT(test::rel_l2(dys, num_ys), 1e-6);
    EXPECT_LT(test::rel_l2(dw, num_w), 1e-6);
    for (int64_t a = 0; a < M * k; ++a)
      if (p.pos[size_t(a)] < 0) {
        EXPECT_EQ(dw[size_t(a)], 0.0f) << a;
      }
    if (capacity > 0) {
      EXPECT_GT(p.dropped, 0);
    }

    // bf16 ys (read widened) and bf16 dys (rounded).
    const auto ys16 = to_bf16(ys);
    const auto wide = widen(ys16);
    std::vector<float> dys_w(dys.size()), dw_w(dw.size()), dys_a(dys.size()), dw_a(dw.size()),
        dw_b(dw.size()), dw_c(dw.size());
    std::vector<bf16> dys16(dys.size()), dys16b(dys.size());
    cpu::moe_combine_backward(r.data(), wide.data(), p.N, w.data(), p.pos.data(), M, k, d,
                              dys_w.data(), dw_w.data());
    cpu::moe_combine_backward(r.data(), ys16.data(), p.N, w.data(), p.pos.data(), M, k, d,
                              dys_a.data(), dw_a.data());
    EXPECT_TRUE(same_bits(dys_a, dys_w));
    EXPECT_TRUE(same_bits(dw_a, dw_w));
    cpu::moe_combine_backward(r.data(), ys16.data(), p.N, w.data(), p.pos.data(), M, k, d,
                              dys16.data(), dw_b.data());
    EXPECT_TRUE(same_bits(dys16, to_bf16(dys_w)));
    EXPECT_TRUE(same_bits(dw_b, dw_w));
    cpu::moe_combine_backward(r.data(), ys.data(), p.N, w.data(), p.pos.data(), M, k, d,
                              dys16b.data(), dw_c.data());
    EXPECT_TRUE(same_bits(dys16b, to_bf16(dys)));
    EXPECT_TRUE(same_bits(dw_c, dw));
  }
}

// Sizes past the kernels' threading threshold: 1 and 2 threads give the same bits.
TEST(Moe, ResultsDoNotDependOnTheThreadCount) {
  const int64_t M = 2048, E = 16, k = 2, d = 48;
  const auto logits = test::randn(size_t(M * E), 23, 2.0f);
  const auto bias = test::randn(size_t(E), 24, 0.01f);
  const auto dw = test::randn(size_t(M * k), 25);
  const auto dprob = test::randn(size_t(E), 26);
  struct Out {
    std::vector<float> probs, weights, prob_sum, dlogits, dxs_sum, y, dys, dweights;
    std::vector<int32_t> experts, pos, order;
  };
  auto run = [&] {
    Out o;
    o.probs.resize(size_t(M * E));
    o.weights.resize(size_t(M * k));
    o.experts.resize(size_t(M * k));
    o.prob_sum.assign(size_t(E), 0.5f);
    cpu::moe_route(logits.data(), bias.data(), M, E, k, true, o.probs.data(), o.experts.data(),
                   o.weights.data(), o.prob_sum.data());
    o.dlogits.resize(size_t(M * E));
    cpu::moe_route_backward(o.probs.data(), o.experts.data(), o.weights.data(), dw.data(), M, E, k,
                            true, dprob.data(), o.dlogits.data());
    std::vector<int64_t> counts(static_cast<size_t>(E));
    o.pos.resize(size_t(M * k));
    cpu::moe_permute(o.experts.data(), M, k, E, 300, counts.data(), o.pos.data());
    const int64_t N = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    o.order.resize(size_t(N));
    cpu::moe_permute_order(o.pos.data(), M * k, N, o.order.data());
    const auto x = test::randn(size_t(M * d), 27);
    std::vector<float> xs(size_t(N * d));
    cpu::moe_dispatch(x.data(), M, d, o.order.data(), N, k, xs.data());
    o.dxs_sum = test::randn(size_t(M * d), 28);
    cpu::moe_dispatch_backward(xs.data(), N, o.pos.data(), M, k, d, o.dxs_sum.data(), true);
    o.y = test::randn(size_t(M * d), 29);
    cpu::moe_combine(xs.data(), N, o.weights.data(), o.pos.data(), M, k, d, o.y.data());
    o.dys.resize(size_t(N * d));
    o.dweights.resize(size_t(M * k));
    cpu::moe_combine_backward(x.data(), xs.data(), N, o.weights.data(), o.pos.data(), M, k, d,
                              o.dys.data(), o.dweights.data());
    return o;
  };
  Out one, two;
  with_threads(1, [&] { one = run(); });
  with_threads(2, [&] { two = run(); });
  EXPECT_TRUE(same_bits(one.probs, two.probs));
  EXPECT_TRUE(same_bits(one.experts, two.experts));
  EXPECT_TRUE(same_bits(one.weights, two.weights));
  EXPECT_TRUE(same_bits(one.prob_sum, two.prob_sum));
  EXPECT_TRUE(same_bits(one.dlogits, two.dlogits));
  EXPECT_TRUE(same_bits(one.pos, two.pos));
  EXPECT_TRUE(same_bits(one.order, two.order));
  EXPECT_TRUE(same_bits(one.dxs_sum, two.dxs_sum));
  EXPECT_TRUE(same_bits(one.y, two.y));
  EXPECT_TRUE(same_bits(one.dys, two.dys));
  EXPECT_TRUE(same_bits(one.dweights, two.dweights));
}

// Indices out of range are errors naming the kernel and the index, before anything runs.
TEST(Moe, KernelsCheckTheirIndices) {
  std::vector<float> f(64, 1.0f), out(64);
  std::vector<int32_t> experts = {0, 1, 2, 4}, pos(4);
  std::vector<int64_t> counts(4);
  test::expect_error(
      [&] { cpu::moe_permute(experts.data(), 2, 2, 4, 0, counts.data(), pos.data()); },
      {"moe_permute", "expert index 4", "[0, 4)"});
  test::expect_error(
      [&] { cpu::moe_permute(experts.data(), 2, 2, 5, -1, counts.data(), pos.data()); },
      {"moe_permute", "capacity"});
  test::expect_error(
      [&] {
        cpu::moe_route(f.data(), nullptr, 2, 4, 5, false, out.data(), pos.data(), out.data(),
                       nullptr);
      },
      {"moe_route", "k (experts per token)", "[1, E = 4]"});
  test::expect_error(
      [&] {
        cpu::moe_route_backward(f.data(), experts.data(), f.data(), f.data(), 2, 4, 2, true,
                                nullptr, out.data());
      },
      {"moe_route_backward", "expert index 4"});
  std::vector<int32_t> bad_pos = {0, -1, 3, 1};
  test::expect_error(
      [&] { cpu::moe_combine(f.data(), 3, f.data(), bad_pos.data(), 2, 2, 4, out.data()); },
      {"moe_combine", "row 3", "[-1, 3)"});
  test::expect_error(
      [&] { cpu::moe_dispatch_backward(f.data(), 3, bad_pos.data(), 2, 2, 4, out.data(), false); },
      {"moe_dispatch_backward", "row 3"});
  std::vector<int32_t> bad_order = {0, 4};
  test::expect_error([&] { cpu::moe_dispatch(f.data(), 2, 4, bad_order.data(), 2, 2, out.data()); },
                     {"moe_dispatch", "assignment 4", "M*k = 4"});
  std::vector<int32_t> twice = {0, 0, -1, 1}, order(2);
  test::expect_error([&] { cpu::moe_permute_order(twice.data(), 4, 2, order.data()); },
                     {"moe_permute_order", "row 0"});
}
