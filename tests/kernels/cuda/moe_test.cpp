// The CUDA mixture-of-experts kernels against the CPU kernels (kernels/cpu/moe.hpp, themselves
// checked against fp64 references in tests/kernels/moe_test.cpp), on random inputs (never zeros),
// outputs filled with NaN (or a sentinel index) first: the router (ties, a selection bias, in
// place, Qwen3-30B-A3B's 128 experts and DeepSeek's 256), its backward bit for bit, the counting
// sort (an expert with no rows, a capacity that drops, one per expert, several chunks, a bad expert
// index), the gather, the weighted sum and their backwards in f32 and bf16 (odd widths, a pointer
// that is not 16-byte aligned), a zero-row input each, and a bad row index giving NaN rows, never
// a crash.
#include "kernels/cuda/moe.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/moe.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

using test::dev;
using test::nan_dev;

class MoeCuda : public test::CudaTest {};

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// ---- device arrays of int32 (at least one element: a zero-row case has nothing to hold)

Tensor dev_i32(std::vector<int32_t> v) {
  if (v.empty()) v.push_back(-77);
  return test::to_device_i32(v);
}
std::vector<int32_t> host_i32(const Tensor& d, size_t n) {
  Tensor h = Tensor::empty(d.shape(), DType::i32);
  h.copy_from(d);
  return std::vector<int32_t>(h.data<int32_t>(), h.data<int32_t>() + n);
}
std::vector<float> host_f32(const Tensor& d, size_t n) {
  std::vector<float> v = test::to_host(d);
  v.resize(n);
  return v;
}
Tensor dev_f32(std::vector<float> v) {
  if (v.empty()) v.push_back(kNan);
  return test::to_device(v);
}

// ---- comparisons

float value(float v) {
  return v;
}
float value(bf16 v) {
  return bf16_to_float(v);
}
// Every element with the CPU's bits (NaN patterns included).
template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && ++bad <= 5)
      ADD_FAILURE() << what << " [" << i << "]: " << value(got[i]) << " vs the CPU's "
                    << value(want[i]);
  EXPECT_EQ(bad, 0u) << what;
}
// |got - want| <= bound[i] everywhere (and never NaN).
void expect_within(const std::vector<float>& got, const std::vector<float>& want,
                   const std::vector<double>& bound, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(double(got[i]) - double(want[i])) <= bound[i]) && ++bad <= 5)
      ADD_FAILURE() << what << " [" << i << "]: " << got[i] << " vs the CPU's " << want[i]
                    << " (bound " << bound[i] << ")";
  EXPECT_EQ(bad, 0u) << what;
}
// An f32 ulp of |v| (the spacing at v).
double ulp(float v) {
  const float a = std::abs(v);
  return double(std::nextafter(a, std::numeric_limits<float>::infinity()) - a);
}
bool all_nan(const std::vector<float>& v, size_t from, size_t n) {
  for (size_t i = from; i < from + n; ++i)
    if (!std::isnan(v[i])) return false;
  return true;
}

// ---- the router

struct RouteShape {
  int64_t M, E, k;
};
// Zero tokens, k = E, k = 1, small, Qwen3-30B-A3B's 128 experts and DeepSeek-V3's 256 (top-8).
const std::vector<RouteShape> kRouteShapes = {{0, 8, 2},    {1, 4, 4},     {17, 5, 1},  {37, 8, 2},
                                              {300, 64, 8}, {129, 128, 8}, {50, 256, 8}};

std::string name(const RouteShape& s) {
  return "M " + std::to_string(s.M) + ", E " + std::to_string(s.E) + ", k " + std::to_string(s.k);
}

// Logits of a few units' scale; row 0 all equal (a k-way tie: experts 0..k-1) and row 1 in equal
// pairs (each pair a tie), the ties exact on both devices (equal inputs, equal exps).
std::vector<float> route_logits(const RouteShape& s, uint64_t seed) {
  std::vector<float> v = test::randn(size_t(s.M * s.E), seed, 2.0f);
  for (int64_t e = 0; s.M > 0 && e < s.E; ++e) v[size_t(e)] = 0.5f;
  for (int64_t e = 0; s.M > 1 && e < s.E; ++e) v[size_t(s.E + e)] = 0.25f * float(e / 2);
  return v;
}

// The CPU kernel's choice on given probabilities (its k passes of a strict-> argmax over
// probs + bias, the weights renormalized in f32): the GPU's experts and weights must follow its
// own probabilities bit for bit.
void top_k(const float* p, const float* bias, int64_t E, int64_t k, bool renormalize, int32_t* ex,
           float* w) {
  std::vector<uint8_t> taken(size_t(E), 0);
  float s = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (taken[size_t(e)]) continue;
      const float sc = bias ? p[e] + bias[e] : p[e];
      const float sb = best < 0 ? 0.0f : (bias ? p[best] + bias[best] : p[best]);
      if (best < 0 || sc > sb) best = e;
    }
    taken[size_t(best)] = 1;
    ex[j] = int32_t(best);
    w[j] = p[best];
    s += p[best];
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) w[j] /= s;
}

TEST_F(MoeCuda, RouteMatchesCpu) {
  for (const RouteShape& s : kRouteShapes)
    for (const bool biased : {false, true})
      for (const bool renormalize : {false, true})
        for (const bool in_place : {false, true}) {
          SCOPED_TRACE(name(s) + (biased ? ", bias" : "") + (renormalize ? ", renormalized" : "") +
                       (in_place ? ", in place" : ""));
          const int64_t M = s.M, E = s.E, k = s.k;
          const std::vector<float> logits = route_logits(s, 11 + uint64_t(M));
          const std::vector<float> bias = test::randn(size_t(E), 12, 0.05f);
          const std::vector<float> ps0 = test::randn(size_t(E), 13);
          std::vector<float> probs(logits.size()), w(size_t(M * k)), ps = ps0;
          std::vector<int32_t> ex(size_t(M * k));
          const float* b = biased ? bias.data() : nullptr;
          cpu::moe_route(logits.data(), b, M, E, k, renormalize, probs.data(), ex.data(), w.data(),
                         ps.data());

          Tensor gl = dev_f32(logits), gb = dev_f32(bias), gps = dev_f32(ps0);
          Tensor gp = in_place ? gl : dev_f32(std::vector<float>(logits.size(), kNan));
          Tensor gex = dev_i32(std::vector<int32_t>(ex.size(), -7));
          Tensor gw = dev_f32(std::vector<float>(w.size(), kNan));
          cuda::moe_route(gl.data<float>(), biased ? gb.data<float>() : nullptr, M, E, k,
                          renormalize, gp.data<float>(), gex.data<int32_t>(), gw.data<float>(),
                          gps.data<float>());
          const std::vector<float> p_g = host_f32(gp, probs.size()), w_g = host_f32(gw, w.size());
          const std::vector<int32_t> ex_g = host_i32(gex, ex.size());

          // The probabilities: within 2 f32 ulp of the CPU's (the exps may differ in the last
          // bit), and nearly all the CPU's bits.
          size_t equal = 0;
          std::vector<double> bound(probs.size());
          for (size_t i = 0; i < probs.size(); ++i) {
            bound[i] = 2 * ulp(probs[i]);
            equal += std::memcmp(&p_g[i], &probs[i], 4) == 0;
          }
          expect_within(p_g, probs, bound, "probs");
          EXPECT_GE(equal, probs.size() * 98 / 100) << "probs with the CPU's bits";
          // The choice and weights follow the GPU's probabilities bit for bit.
          std::vector<int32_t> ex_want(ex.size());
          std::vector<float> w_want(w.size());
          for (int64_t t = 0; t < M; ++t)
            top_k(&p_g[size_t(t * E)], b, E, k, renormalize, &ex_want[size_t(t * k)],
                  &w_want[size_t(t * k)]);
          expect_same(ex_g, ex_want, "experts from the GPU's probs");
          expect_same(w_g, w_want, "weights from the GPU's probs");
          // And the CPU's choice, but where two scores are within an ulp (none seen so far); the
          // tie rows exactly.
          int64_t differ = 0;
          for (int64_t a = 0; a < M * k; ++a) {
            if (ex_g[size_t(a)] == ex[size_t(a)]) continue;
            ++differ;
            const float* pt = &probs[size_t(a / k * E)];
            auto score = [&](int32_t e) { return b ? pt[e] + b[e] : pt[e]; };
            EXPECT_LE(std::abs(score(ex_g[size_t(a)]) - score(ex[size_t(a)])),
                      2 * ulp(score(ex[size_t(a)])))
                << "assignment " << a << ": expert " << ex_g[size_t(a)] << ", the CPU's "
                << ex[size_t(a)];
            EXPECT_GE(a, 2 * k) << "a tie row chose differently";
          }
          EXPECT_LE(differ, M * k / 100) << "choices apart from the CPU's";
          // prob_sum: the columns summed in double, in another order: within a rounding of the
          // CPU's, plus the probabilities' own ulps.
          std::vector<double> pb(static_cast<size_t>(E));
          for (int64_t e = 0; e < E; ++e) {
            double col = 0;
            for (int64_t t = 0; t < M; ++t) col += probs[size_t(t * E + e)];
            pb[size_t(e)] = ulp(ps[size_t(e)]) + 5e-7 * col;
          }
          expect_within(host_f32(gps, size_t(E)), ps, pb, "prob_sum");
        }
}

TEST_F(MoeCuda, RouteBackwardMatchesCpuBitForBit) {
  for (const RouteShape& s : kRouteShapes)
    for (const bool renormalize : {false, true})
      for (const bool aux : {false, true})
        for (const bool in_place : {false, true}) {
          SCOPED_TRACE(name(s) + (renormalize ? ", renormalized" : "") + (aux ? ", dprob" : "") +
                       (in_place ? ", in place" : ""));
          const int64_t M = s.M, E = s.E, k = s.k;
          const std::vector<float> logits = route_logits(s, 21 + uint64_t(M));
          std::vector<float> probs(logits.size()), w(size_t(M * k));
          std::vector<int32_t> ex(size_t(M * k));
          cpu::moe_route(logits.data(), nullptr, M, E, k, renormalize, probs.data(), ex.data(),
                         w.data(), nullptr);
          const std::vector<float> dw = test::randn(w.size(), 22);
          const std::vector<float> dprob = test::randn(size_t(E), 23, 0.1f);
          const float* dp = aux ? dprob.data() : nullptr;
          std::vector<float> dl(probs.size());
          cpu::moe_route_backward(probs.data(), ex.data(), w.data(), dw.data(), M, E, k,
                                  renormalize, dp, dl.data());

          // A token whose expert index is out of range gets a NaN row on the GPU (the CPU throws).
          std::vector<int32_t> ex_bad = ex;
          if (M > 2) ex_bad[size_t(2 * k + k - 1)] = int32_t(E);
          Tensor gp = dev_f32(probs), gex = dev_i32(ex_bad), gw = dev_f32(w), gdw = dev_f32(dw);
          Tensor gdp = dev_f32(dprob);
          Tensor gdl = in_place ? gp : dev_f32(std::vector<float>(dl.size(), kNan));
          cuda::moe_route_backward(gp.data<float>(), gex.data<int32_t>(), gw.data<float>(),
                                   gdw.data<float>(), M, E, k, renormalize,
                                   aux ? gdp.data<float>() : nullptr, gdl.data<float>());
          std::vector<float> dl_g = host_f32(gdl, dl.size());
          if (M > 2) {
            EXPECT_TRUE(all_nan(dl_g, size_t(2 * E), size_t(E))) << "the bad token's row";
            std::fill(dl.begin() + 2 * E, dl.begin() + 3 * E, kNan);
          }
          expect_same(dl_g, dl, "dlogits");
        }
}

// ---- tokens grouped by expert

struct PermuteCase {
  int64_t M, k, E, capacity;
  int32_t empty;  // an expert no token chooses (-1: none)
  int32_t hot;    // an expert half the choices go to (-1: none)
};
// Zero tokens; one token one expert; small with and without a capacity; several chunks of 512
// assignments; 300 experts (not a multiple of 32); every choice one expert's.
const std::vector<PermuteCase> kPermuteCases = {
    {0, 2, 8, 0, -1, -1},         {1, 1, 1, 0, -1, -1},    {37, 2, 8, 0, 3, -1},
    {37, 2, 8, 5, 3, 6},          {1000, 8, 64, 0, 0, 17}, {3000, 2, 16, 300, 15, 2},
    {700, 4, 300, 0, 299, 5},     {5000, 1, 8, 0, -1, 4},  {5000, 1, 8, 1000, 7, 4},
    {2048, 8, 128, 150, 100, 127}};

std::string name(const PermuteCase& c) {
  return "M " + std::to_string(c.M) + ", k " + std::to_string(c.k) + ", E " + std::to_string(c.E) +
         ", capacity " + std::to_string(c.capacity);
}

std::vector<int32_t> random_experts(const PermuteCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> any(0, int32_t(c.E - 1));
  std::vector<int32_t> ex(size_t(c.M * c.k));
  for (auto& e : ex) {
    if (c.hot >= 0 && rng() % 2 == 0) {
      e = c.hot;
      continue;
    }
    do e = any(rng);
    while (e == c.empty && c.E > 1);
  }
  return ex;
}

// The CPU's grouping of `experts`: pos, order, counts and the rows kept.
struct Grouping {
  std::vector<int32_t> pos, order;
  std::vector<int64_t> counts;
  int64_t N = 0, dropped = 0;
};
Grouping cpu_grouping(const std::vector<int32_t>& experts, int64_t M, int64_t k, int64_t E,
                      int64_t capacity) {
  Grouping g;
  g.pos.resize(experts.size());
  g.counts.resize(size_t(E));
  g.dropped = cpu::moe_permute(experts.data(), M, k, E, capacity, g.counts.data(), g.pos.data());
  for (int64_t c : g.counts) g.N += c;
  g.order.resize(size_t(g.N));
  cpu::moe_permute_order(g.pos.data(), M * k, g.N, g.order.data());
  return g;
}

TEST_F(MoeCuda, PermuteMatchesCpu) {
  for (const PermuteCase& c : kPermuteCases) {
    SCOPED_TRACE(name(c));
    const std::vector<int32_t> experts = random_experts(c, 31 + uint64_t(c.M));
    const Grouping want = cpu_grouping(experts, c.M, c.k, c.E, c.capacity);
    if (c.empty >= 0) {
      ASSERT_EQ(want.counts[size_t(c.empty)], 0);
    }

    Tensor gex = dev_i32(experts), gpos = dev_i32(std::vector<int32_t>(experts.size(), -99));
    std::vector<int64_t> counts(size_t(c.E), -5);
    const std::vector<int64_t> each(size_t(c.E), c.capacity);
    const int64_t dropped = cuda::moe_permute_per_expert(gex.data<int32_t>(), c.M, c.k, c.E,
                                                         c.capacity > 0 ? each.data() : nullptr,
                                                         counts.data(), gpos.data<int32_t>());
    EXPECT_EQ(dropped, want.dropped);
    EXPECT_EQ(counts, want.counts);
    expect_same(host_i32(gpos, experts.size()), want.pos, "pos");
    Tensor gorder = dev_i32(std::vector<int32_t>(size_t(want.N), -99));
    cuda::moe_permute_order(gpos.data<int32_t>(), c.M * c.k, want.N, gorder.data<int32_t>());
    expect_same(host_i32(gorder, size_t(want.N)), want.order, "order");
  }
}

// A capacity per expert (context parallelism's, model/moe_capacity.hpp): some 0, some below and
// some above the expert's choices.
TEST_F(MoeCuda, PermutePerExpertCapacityMatchesCpu) {
  for (const PermuteCase& c : kPermuteCases) {
    SCOPED_TRACE(name(c));
    const std::vector<int32_t> experts = random_experts(c, 35 + uint64_t(c.M));
    std::mt19937_64 rng(36);
    std::vector<int64_t> cap(size_t(c.E));
    for (auto& v : cap) v = int64_t(rng() % uint64_t(2 * c.M * c.k / c.E + 2));
    cap[0] = 0;
    std::vector<int32_t> want_pos(experts.size());
    std::vector<int64_t> want_counts(size_t(c.E));
    const int64_t want = cpu::moe_permute_per_expert(experts.data(), c.M, c.k, c.E, cap.data(),
                                                     want_counts.data(), want_pos.data());
    Tensor gex = dev_i32(experts), gpos = dev_i32(std::vector<int32_t>(experts.size(), -99));
    std::vector<int64_t> counts(size_t(c.E), -5);
    const int64_t dropped = cuda::moe_permute_per_expert(
        gex.data<int32_t>(), c.M, c.k, c.E, cap.data(), counts.data(), gpos.data<int32_t>());
    EXPECT_EQ(dropped, want);
    EXPECT_EQ(counts, want_counts);
    expect_same(host_i32(gpos, experts.size()), want_pos, "pos");
  }
  std::vector<int64_t> cap = {3, -1, 2, 2};
  Tensor gex = dev_i32({1, 2});
  std::vector<int64_t> counts(4);
  test::expect_error(
      [&] {
        cuda::moe_permute_per_expert(gex.data<int32_t>(), 1, 2, 4, cap.data(), counts.data(),
                                     nullptr);
      },
      {"moe_permute", "expert 1's capacity", "-1"});
}

TEST_F(MoeCuda, PermuteRefusesABadExpertIndexBeforeWriting) {
  const PermuteCase c{1000, 2, 8, 0, -1, -1};
  for (const int32_t bad : {8, -3}) {
    std::vector<int32_t> experts = random_experts(c, 41);
    experts[1500] = 9;    // a later bad one: the first is named, as on the CPU
    experts[1033] = bad;  // in the third chunk of 512
    Tensor gex = dev_i32(experts), gpos = dev_i32(std::vector<int32_t>(experts.size(), -99));
    std::vector<int64_t> counts(size_t(c.E));
    test::expect_error(
        [&] {
          cuda::moe_permute_per_expert(gex.data<int32_t>(), c.M, c.k, c.E, nullptr, counts.data(),
                                       gpos.data<int32_t>());
        },
        {"moe_permute", "expert index " + std::to_string(bad), "assignment 1033",
         "out of range [0, 8)"});
    const std::vector<int32_t> pos = host_i32(gpos, experts.size());
    EXPECT_TRUE(std::all_of(pos.begin(), pos.end(), [](int32_t p) { return p == -99; }))
        << "pos written before the check";
  }
  Tensor gex = dev_i32({1, 2});
  std::vector<int64_t> counts(4);
  test::expect_error(
      [&] {
        cuda::moe_permute_per_expert(gex.data<int32_t>(), 1, 5, 4, nullptr, counts.data(), nullptr);
      },
      {"moe_permute", "k (experts per token)", "[1, E = 4]"});
}

// ---- the gather, the weighted sum and their backwards

// A routed batch: M tokens, k choices among E experts with expert 2 chosen by none, a capacity
// that drops some (or none), and the CPU's grouping.
struct Routed {
  int64_t M, k, E;
  std::vector<int32_t> experts;
  Grouping g;
};
Routed routed(int64_t M, int64_t capacity, uint64_t seed) {
  const PermuteCase c{M, 2, 8, capacity, 2, 5};
  Routed r{M, c.k, c.E, random_experts(c, seed), {}};
  r.g = cpu_grouping(r.experts, M, c.k, c.E, capacity);
  return r;
}

// Widths: 5 and 7 (element by element), 8, 64 and Qwen3-30B-A3B's 2048.
const std::vector<int64_t> kWidths = {5, 7, 8, 64, 2048};

TEST_F(MoeCuda, DispatchMatchesCpu) {
  for (const int64_t M : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{300}})
    for (const int64_t capacity : {int64_t{0}, M / 4 + 1})
      for (const int64_t d : kWidths)
        for (const int64_t off : {0, 1}) {
          SCOPED_TRACE("M " + std::to_string(M) + ", capacity " + std::to_string(capacity) +
                       ", d " + std::to_string(d) + ", offset " + std::to_string(off));
          const Routed r = routed(M, capacity, 51 + uint64_t(M));
          const int64_t N = r.g.N, k = r.k;
          const std::vector<float> x = test::randn(size_t(M * d), 52);
          // A bad order index (past M*k) in the last row: that row NaN.
          std::vector<int32_t> order = r.g.order;
          if (N > 1) order.back() = int32_t(M * k);
          Tensor go = dev_i32(order);
          // f32
          std::vector<float> xs(size_t(N * d));
          cpu::moe_dispatch(x.data(), M, d, r.g.order.data(), N, k, xs.data());
          test::Dev gx = dev(x, off), gxs = nan_dev(N * d, off);
          cuda::moe_dispatch(gx.f(), M, d, go.data<int32_t>(), N, k, gxs.f());
          if (N > 1) std::fill(xs.end() - d, xs.end(), kNan);
          expect_same(gxs.host(), xs, "xs f32");
          // bf16
          const std::vector<bf16> x16 = test::round_bf16(x);
          std::vector<bf16> xs16(size_t(N * d));
          cpu::moe_dispatch(x16.data(), M, d, r.g.order.data(), N, k, xs16.data());
          test::Dev hx = dev(x, off, DType::bf16), hxs = nan_dev(N * d, off, DType::bf16);
          cuda::moe_dispatch(hx.h(), M, d, go.data<int32_t>(), N, k, hxs.h());
          if (N > 1) std::fill(xs16.end() - d, xs16.end(), float_to_bf16(kNan));
          expect_same(hxs.host_bf16(), xs16, "xs bf16");
        }
}

TEST_F(MoeCuda, DispatchBackwardMatchesCpu) {
  for (const int64_t M : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{300}})
    for (const int64_t capacity : {int64_t{0}, M / 4 + 1})
      for (const int64_t d : kWidths)
        for (const bool accumulate : {false, true}) {
          SCOPED_TRACE("M " + std::to_string(M) + ", capacity " + std::to_string(capacity) +
                       ", d " + std::to_string(d) + (accumulate ? ", accumulated" : ""));
          const Routed r = routed(M, capacity, 61 + uint64_t(M));
          const int64_t N = r.g.N, k = r.k;
          const std::vector<float> dxs = test::randn(size_t(N * d), 62);
          const std::vector<float> dx0 = test::randn(size_t(M * d), 63);
          std::vector<float> dx = accumulate ? dx0 : std::vector<float>(dx0.size(), kNan);
          cpu::moe_dispatch_backward(dxs.data(), N, r.g.pos.data(), M, k, d, dx.data(), accumulate);
          // Token 1's second choice pointing past N: its row NaN.
          std::vector<int32_t> pos = r.g.pos;
          if (M > 1) pos[size_t(k + 1)] = int32_t(N);
          Tensor gdxs = dev_f32(dxs), gpos = dev_i32(pos);
          Tensor gdx = dev_f32(accumulate ? dx0 : std::vector<float>(dx0.size(), kNan));
          cuda::moe_dispatch_backward(gdxs.data<float>(), N, gpos.data<int32_t>(), M, k, d,
                                      gdx.data<float>(), accumulate);
          if (M > 1) std::fill(dx.begin() + d, dx.begin() + 2 * d, kNan);
          expect_same(host_f32(gdx, dx.size()), dx, "dx");
        }
}

TEST_F(MoeCuda, CombineMatchesCpu) {
  for (const int64_t M : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{300}})
    for (const int64_t capacity : {int64_t{0}, M / 4 + 1})
      for (const int64_t d : kWidths) {
        SCOPED_TRACE("M " + std::to_string(M) + ", capacity " + std::to_string(capacity) + ", d " +
                     std::to_string(d));
        const Routed r = routed(M, capacity, 71 + uint64_t(M));
        const int64_t N = r.g.N, k = r.k;
        const std::vector<float> ys = test::randn(size_t(N * d), 72);
        const std::vector<float> w = test::randn(size_t(M * k), 73, 0.5f);
        const std::vector<float> y0 = test::randn(size_t(M * d), 74);
        std::vector<int32_t> pos = r.g.pos;
        if (M > 1) pos[size_t(k)] = -2;  // token 1: a bad row index, its row NaN
        Tensor gw = dev_f32(w), gpos = dev_i32(pos);
        for (const bool half : {false, true}) {
          SCOPED_TRACE(half ? "ys bf16" : "ys f32");
          std::vector<float> y = y0;
          const std::vector<bf16> ys16 = test::round_bf16(ys);
          if (half)
            cpu::moe_combine(ys16.data(), N, w.data(), r.g.pos.data(), M, k, d, y.data());
          else
            cpu::moe_combine(ys.data(), N, w.data(), r.g.pos.data(), M, k, d, y.data());
          Tensor gy = dev_f32(y0), gys = test::to_device(ys, half ? DType::bf16 : DType::f32);
          if (half)
            cuda::moe_combine(gys.data<bf16>(), N, gw.data<float>(), gpos.data<int32_t>(), M, k, d,
                              gy.data<float>());
          else
            cuda::moe_combine(gys.data<float>(), N, gw.data<float>(), gpos.data<int32_t>(), M, k, d,
                              gy.data<float>());
          if (M > 1) std::fill(y.begin() + d, y.begin() + 2 * d, kNan);
          expect_same(host_f32(gy, y.size()), y, "y");
        }
      }
}

// The CPU's combine backward for one pair of dtypes, and the GPU's on the same inputs: dys with the
// CPU's bits, dweights within a rounding of the CPU's double dot (0 exactly where dropped).
template <class Y, class D>
void check_combine_backward(const Routed& r, int64_t d, uint64_t seed) {
  const int64_t M = r.M, N = r.g.N, k = r.k;
  const std::vector<float> dy = test::randn(size_t(M * d), seed);
  const std::vector<float> ys32 = test::randn(size_t(N * d), seed + 1);
  const std::vector<float> w = test::randn(size_t(M * k), seed + 2, 0.5f);
  std::vector<Y> ys(ys32.size());
  for (size_t i = 0; i < ys.size(); ++i) {
    if constexpr (sizeof(Y) == 2)
      ys[i] = float_to_bf16(ys32[i]);
    else
      ys[i] = ys32[i];
  }
  std::vector<D> dys(size_t(N * d));
  std::vector<float> dw(size_t(M * k));
  cpu::moe_combine_backward(dy.data(), ys.data(), N, w.data(), r.g.pos.data(), M, k, d, dys.data(),
                            dw.data());
  constexpr DType ydt = sizeof(Y) == 2 ? DType::bf16 : DType::f32;
  constexpr DType ddt = sizeof(D) == 2 ? DType::bf16 : DType::f32;
  std::vector<float> ys_w(ys.size());
  for (size_t i = 0; i < ys.size(); ++i) ys_w[i] = value(ys[i]);
  Tensor gdy = dev_f32(dy), gys = test::to_device(ys_w, ydt), gw = dev_f32(w);
  Tensor gpos = dev_i32(r.g.pos), gdw = dev_f32(std::vector<float>(dw.size(), kNan));
  Tensor gdys = test::nan_device(std::max<int64_t>(N * d, 1), ddt);
  cuda::moe_combine_backward(gdy.data<float>(), gys.data<Y>(), N, gw.data<float>(),
                             gpos.data<int32_t>(), M, k, d, gdys.data<D>(), gdw.data<float>());
  if constexpr (sizeof(D) == 2) {
    std::vector<bf16> got = test::to_host_bf16(gdys);
    got.resize(dys.size());
    expect_same(got, dys, "dys bf16");
  } else {
    expect_same(host_f32(gdys, dys.size()), dys, "dys f32");
  }
  // dweights: sum_c |dy ys| bounds the double sums' difference.
  std::vector<double> bound(dw.size());
  for (int64_t a = 0; a < M * k; ++a) {
    const int32_t p = r.g.pos[size_t(a)];
    double mag = 0;
    for (int64_t c = 0; p >= 0 && c < d; ++c)
      mag += std::abs(double(dy[size_t(a / k * d + c)]) * double(ys_w[size_t(p * d + c)]));
    bound[size_t(a)] = p < 0 ? 0.0 : ulp(dw[size_t(a)]) + 1e-12 * mag;
  }
  expect_within(host_f32(gdw, dw.size()), dw, bound, "dweights");
}

TEST_F(MoeCuda, CombineBackwardMatchesCpu) {
  for (const int64_t M : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{300}})
    for (const int64_t capacity : {int64_t{0}, M / 4 + 1})
      for (const int64_t d : kWidths) {
        SCOPED_TRACE("M " + std::to_string(M) + ", capacity " + std::to_string(capacity) + ", d " +
                     std::to_string(d));
        const Routed r = routed(M, capacity, 81 + uint64_t(M));
        {
          SCOPED_TRACE("ys f32, dys f32");
          check_combine_backward<float, float>(r, d, 82);
        }
        {
          SCOPED_TRACE("ys bf16, dys f32");
          check_combine_backward<bf16, float>(r, d, 83);
        }
        {
          SCOPED_TRACE("ys f32, dys bf16");
          check_combine_backward<float, bf16>(r, d, 84);
        }
        {
          SCOPED_TRACE("ys bf16, dys bf16");
          check_combine_backward<bf16, bf16>(r, d, 85);
        }
      }
}

TEST_F(MoeCuda, CombineBackwardBadRowIsNan) {
  const Routed r = routed(5, 0, 91);
  const int64_t M = r.M, N = r.g.N, k = r.k, d = 16;
  std::vector<int32_t> pos = r.g.pos;
  pos[3] = int32_t(N);  // past the rows
  Tensor gdy = dev_f32(test::randn(size_t(M * d), 92)),
         gys = dev_f32(test::randn(size_t(N * d), 93));
  Tensor gw = dev_f32(test::randn(size_t(M * k), 94)), gpos = dev_i32(pos);
  Tensor gdys = test::nan_device(N * d), gdw = dev_f32(std::vector<float>(size_t(M * k), 1.0f));
  cuda::moe_combine_backward(gdy.data<float>(), gys.data<float>(), N, gw.data<float>(),
                             gpos.data<int32_t>(), M, k, d, gdys.data<float>(), gdw.data<float>());
  const std::vector<float> dw = host_f32(gdw, size_t(M * k));
  for (int64_t a = 0; a < M * k; ++a) EXPECT_EQ(std::isnan(dw[size_t(a)]), a == 3) << a;
}

}  // namespace
