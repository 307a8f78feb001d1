// The mixture-of-experts ops (ops/ops.hpp): on cpu the bits of kernels/cpu/moe; a whole layer
// (route, permute, dispatch, grouped GEMMs, combine) against a naive per-token mixture; the
// grouped GEMMs and their backward against per-expert GEMMs, an expert without rows included;
// clear errors for wrong arguments; on meta balanced counts, booked memory and work reported,
// nothing computed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "kernels/cpu/moe.hpp"
#include "ops/ops.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::test::same_bits;

namespace {

Tensor random(const Shape& s, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(s, DType::f32);
  const auto v = test::randn(size_t(t.numel()), seed, scale);
  std::memcpy(t.raw(), v.data(), t.nbytes());
  return t;
}

template <class T = float>
std::vector<T> values(const Tensor& t) {
  const T* p = t.data<T>();
  return std::vector<T>(p, p + t.numel());
}

Tensor meta(const Shape& s, DType dt = DType::f32) {
  return Tensor::empty(s, dt, Device::meta);
}

// The router's outputs for M tokens over E experts, k each.
struct Routed {
  Tensor probs, experts, weights, prob_sum;
};
Routed route(const Tensor& logits, int64_t k, bool renormalize) {
  const int64_t M = logits.size(0), E = logits.size(1);
  Routed r{Tensor::empty({M, E}, DType::f32), Tensor::empty({M, k}, DType::i32),
           Tensor::empty({M, k}, DType::f32), Tensor::zeros({E}, DType::f32)};
  ops::moe_route(logits, Tensor(), renormalize, r.probs, r.experts, r.weights, r.prob_sum);
  return r;
}

}  // namespace

TEST(MoeOps, CpuOpsEqualTheKernels) {
  const int64_t M = 45, E = 6, k = 2, d = 13;
  const Tensor logits = random({M, E}, 1, 2.0f), bias = random({E}, 2, 0.05f);
  Tensor probs = Tensor::empty({M, E}, DType::f32), experts = Tensor::empty({M, k}, DType::i32),
         weights = Tensor::empty({M, k}, DType::f32), prob_sum = random({E}, 3);
  std::vector<float> kp(size_t(M * E)), kw(size_t(M * k)), ks = values(prob_sum);
  std::vector<int32_t> ke(size_t(M * k));
  cpu::moe_route(logits.data<float>(), bias.data<float>(), M, E, k, true, kp.data(), ke.data(),
                 kw.data(), ks.data());
  ops::moe_route(logits, bias, true, probs, experts, weights, prob_sum);
  EXPECT_TRUE(same_bits(values(probs), kp));
  EXPECT_TRUE(same_bits(values<int32_t>(experts), ke));
  EXPECT_TRUE(same_bits(values(weights), kw));
  EXPECT_TRUE(same_bits(values(prob_sum), ks));

  const Tensor dweights = random({M, k}, 4), dprob = random({E}, 5);
  Tensor dlogits = Tensor::empty({M, E}, DType::f32);
  std::vector<float> kdl(size_t(M * E));
  cpu::moe_route_backward(kp.data(), ke.data(), kw.data(), dweights.data<float>(), M, E, k, true,
                          dprob.data<float>(), kdl.data());
  ops::moe_route_backward(probs, experts, weights, dweights, true, dprob, dlogits);
  EXPECT_TRUE(same_bits(values(dlogits), kdl));

  // A capacity per expert reaches the kernel as it is.
  const std::vector<int64_t> each = [&] {
    std::vector<int64_t> c;
    for (int64_t e = 0; e < E; ++e) c.push_back(3 + 5 * (e % 4));
    return c;
  }();
  const ops::MoePermutation own = ops::moe_permute(experts, E, each);
  std::vector<int64_t> kc_own(static_cast<size_t>(E));
  std::vector<int32_t> kpos_own(size_t(M * k));
  EXPECT_EQ(own.dropped, cpu::moe_permute_per_expert(ke.data(), M, k, E, each.data(), kc_own.data(),
                                                     kpos_own.data()));
  EXPECT_EQ(own.counts, kc_own);
  EXPECT_TRUE(same_bits(values<int32_t>(own.pos), kpos_own));

  const int64_t capacity = 16;
  const ops::MoePermutation p = ops::moe_permute(experts, E, capacity);
  std::vector<int64_t> kc(static_cast<size_t>(E));
  std::vector<int32_t> kpos(size_t(M * k));
  const int64_t dropped = cpu::moe_permute(ke.data(), M, k, E, capacity, kc.data(), kpos.data());
  const int64_t N = p.rows();
  EXPECT_EQ(p.counts, kc);
  EXPECT_EQ(p.dropped, dropped);
  EXPECT_EQ(N, std::accumulate(kc.begin(), kc.end(), int64_t{0}));
  EXPECT_EQ(p.order.numel(), N);
  EXPECT_EQ(p.order.dtype(), DType::i32);
  EXPECT_EQ(p.order.device(), Device::cpu);
  EXPECT_TRUE(same_bits(values<int32_t>(p.pos), kpos));
  std::vector<int32_t> korder(static_cast<size_t>(N));
  cpu::moe_permute_order(kpos.data(), M * k, N, korder.data());
  EXPECT_TRUE(same_bits(values<int32_t>(p.order), korder));

  const Tensor x = random({M, d}, 6);
  Tensor xs = Tensor::empty({N, d}, DType::f32);
  ops::moe_dispatch(x, p.order, k, xs);
  std::vector<float> kxs(size_t(N * d));
  cpu::moe_dispatch(x.data<float>(), M, d, korder.data(), N, k, kxs.data());
  EXPECT_TRUE(same_bits(values(xs), kxs));
  Tensor x16 = ops::to_compute(x, DType::bf16), xs16 = Tensor::empty({N, d}, DType::bf16);
  ops::moe_dispatch(x16, p.order, k, xs16);
  std::vector<bf16> kxs16(size_t(N * d));
  cpu::moe_dispatch(x16.data<bf16>(), M, d, korder.data(), N, k, kxs16.data());
  EXPECT_TRUE(same_bits(values<bf16>(xs16), kxs16));

  Tensor dx = random({M, d}, 7);
  std::vector<float> kdx = values(dx);
  ops::moe_dispatch_backward(xs, p.pos, k, dx, true);
  cpu::moe_dispatch_backward(kxs.data(), N, kpos.data(), M, k, d, kdx.data(), true);
  EXPECT_TRUE(same_bits(values(dx), kdx));

  Tensor y = random({M, d}, 8);
  std::vector<float> ky = values(y);
  ops::moe_combine(xs16, weights, p.pos, y);
  cpu::moe_combine(kxs16.data(), N, kw.data(), kpos.data(), M, k, d, ky.data());
  EXPECT_TRUE(same_bits(values(y), ky));

  const Tensor dy = random({M, d}, 9);
  Tensor dys = Tensor::empty({N, d}, DType::bf16), dw = Tensor::empty({M, k}, DType::f32);
  ops::moe_combine_backward(dy, xs, weights, p.pos, dys, dw);
  std::vector<bf16> kdys(size_t(N * d));
  std::vector<float> kdw(size_t(M * k));
  cpu::moe_combine_backward(dy.data<float>(), kxs.data(), N, kw.data(), kpos.data(), M, k, d,
                            kdys.data(), kdw.data());
  EXPECT_TRUE(same_bits(values<bf16>(dys), kdys));
  EXPECT_TRUE(same_bits(values(dw), kdw));
}

// One layer: y[t] = sum_j w_tj W_{e_tj} x_t, through route, permute, dispatch, the grouped GEMMs
// and combine, against the fp64 mixture token by token (f32 GEMMs: 1e-5 relative).
TEST(MoeOps, ALayerMatchesANaiveMixture) {
  const int64_t M = 40, E = 5, k = 2, K = 12, F = 9;
  const Tensor logits = random({M, E}, 10, 2.0f), x = random({M, K}, 11);
  std::vector<Tensor> w;
  for (int64_t e = 0; e < E; ++e) w.push_back(random({F, K}, 20 + uint64_t(e)));
  const Routed r = route(logits, k, true);
  const ops::MoePermutation p = ops::moe_permute(r.experts, E, 0);
  const int64_t N = p.rows();
  ASSERT_EQ(N, M * k);
  Tensor xs = Tensor::empty({N, K}, DType::f32), ys = Tensor::empty({N, F}, DType::f32);
  ops::moe_dispatch(x, p.order, k, xs);
  ops::grouped_linear(xs, w, p.counts, ys);
  Tensor y = Tensor::zeros({M, F}, DType::f32);
  ops::moe_combine(ys, r.weights, p.pos, y);

  std::vector<double> ref(size_t(M * F), 0.0);
  const float* xp = x.data<float>();
  const int32_t* ex = r.experts.data<int32_t>();
  const float* wt = r.weights.data<float>();
  for (int64_t t = 0; t < M; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const float* W = w[size_t(ex[t * k + j])].data<float>();
      for (int64_t f = 0; f < F; ++f) {
        double dot = 0;
        for (int64_t c = 0; c < K; ++c) dot += double(W[f * K + c]) * xp[t * K + c];
        ref[size_t(t * F + f)] += double(wt[t * k + j]) * dot;
      }
    }
  EXPECT_LT(test::rel_l2(values(y), ref), 1e-5);
}

// grouped_linear against a GEMM per expert (an expert with no rows between two with some), f32
// and bf16; the backward's dx overwritten and each dW added to (the empty expert's untouched),
// and the same bits with the weight gradients deferred.
TEST(MoeOps, GroupedLinearMatchesPerExpertGemms) {
  const std::vector<int64_t> counts = {3, 0, 5, 1};
  const int64_t E = 4, N = 9, K = 6, F = 7;
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = ops::to_compute(random({N, K}, 30), dt);
    std::vector<Tensor> w;
    for (int64_t e = 0; e < E; ++e)
      w.push_back(ops::to_compute(random({F, K}, 31 + uint64_t(e)), dt));
    Tensor y = Tensor::empty({N, F}, DType::f32);
    ops::grouped_linear(x, w, counts, y);
    // Each expert's rows: the f32 (or widened bf16) values in fp64.
    auto get = [&](const Tensor& t, int64_t i) {
      return dt == DType::bf16 ? double(bf16_to_float(t.data<bf16>()[i]))
                               : double(t.data<float>()[i]);
    };
    const Tensor dy = ops::to_compute(random({N, F}, 40), dt);
    std::vector<double> ref_y(size_t(N * F)), ref_dx(size_t(N * K), 0.0);
    std::vector<std::vector<double>> ref_dw(static_cast<size_t>(E));
    std::vector<Tensor> dw;
    std::vector<ops::WeightGrad> grads;
    for (int64_t e = 0; e < E; ++e) {
      dw.push_back(random({F, K}, 50 + uint64_t(e)));
      const auto init = values(dw.back());
      ref_dw[size_t(e)].assign(init.begin(), init.end());
    }
    for (const Tensor& g : dw) grads.emplace_back(g);
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < counts[size_t(e)]; ++i, ++row)
        for (int64_t f = 0; f < F; ++f) {
          double s = 0;
          for (int64_t c = 0; c < K; ++c) {
            s += get(w[size_t(e)], f * K + c) * get(x, row * K + c);
            ref_dx[size_t(row * K + c)] += get(dy, row * F + f) * get(w[size_t(e)], f * K + c);
            ref_dw[size_t(e)][size_t(f * K + c)] += get(dy, row * F + f) * get(x, row * K + c);
          }
          ref_y[size_t(row * F + f)] = s;
        }
    EXPECT_LT(test::rel_l2(values(y), ref_y), 1e-5);

    Tensor dx = Tensor::empty({N, K}, DType::f32);
    ops::fill(dx, std::numeric_limits<float>::quiet_NaN());
    const std::vector<float> empty_before = values(dw[1]);
    ops::grouped_linear_backward(dy, x, w, counts, grads, dx);
    EXPECT_LT(test::rel_l2(values(dx), ref_dx), 1e-5);
    for (int64_t e = 0; e < E; ++e)
      EXPECT_LT(test::rel_l2(values(dw[size_t(e)]), ref_dw[size_t(e)]), 1e-5) << "expert " << e;
    EXPECT_TRUE(same_bits(values(dw[1]), empty_before));

    // Deferred: dx at once, the dW GEMMs later, the same bits.
    std::vector<Tensor> dw2;
    std::vector<ops::WeightGrad> grads2;
    for (int64_t e = 0; e < E; ++e) dw2.push_back(random({F, K}, 50 + uint64_t(e)));
    for (const Tensor& g : dw2) grads2.emplace_back(g);
    Tensor dx2 = Tensor::empty({N, K}, DType::f32);
    std::vector<ops::DeferredWeightGrad> later;
    {
      ops::DeferWeightGrads defer(later);
      ops::grouped_linear_backward(dy, x, w, counts, grads2, dx2);
    }
    EXPECT_EQ(later.size(), 3u);  // the experts with rows
    EXPECT_TRUE(same_bits(values(dx2), values(dx)));
    ops::run_weight_grads(later);
    for (int64_t e = 0; e < E; ++e)
      EXPECT_TRUE(same_bits(values(dw2[size_t(e)]), values(dw[size_t(e)]))) << "expert " << e;
  }
}

// Deferred (zero-bubble pipelines), the experts' weight gradients keep one copy of dy: the memory
// they hold is the same for any routing, so the meta run's balanced router books what a run holds
// (a copy per expert would round each expert's rows apart: 7 + 5 rows against 4 + 4 + 4 here).
TEST(MoeOps, DeferredGroupedWeightGradientsHoldOneCopyForAnyRouting) {
  const int64_t N = 12, K = 8, F = 6;
  auto& alloc = Allocator::get(Device::meta);
  auto held = [&](std::vector<int64_t> counts) {
    std::vector<Tensor> w(counts.size(), meta({F, K})), g(counts.size(), meta({F, K}));
    std::vector<ops::WeightGrad> dw(g.begin(), g.end());
    Tensor dx = meta({N, K});
    std::vector<ops::DeferredWeightGrad> later;
    const size_t before = alloc.stats().allocated;
    {
      ops::DeferWeightGrads defer(later);
      ops::grouped_linear_backward(meta({N, F}), meta({N, K}), w, counts, dw, dx);
    }
    return alloc.stats().allocated - before;
  };
  const size_t balanced = held({4, 4, 4});
  EXPECT_GT(balanced, 0u);
  EXPECT_EQ(held({7, 0, 5}), balanced);
  EXPECT_EQ(held({12, 0, 0}), balanced);
}

TEST(MoeOps, ChecksTheirArguments) {
  const int64_t M = 4, E = 3, k = 2, d = 5;
  const Tensor logits = random({M, E}, 60);
  Tensor probs = Tensor::empty({M, E}, DType::f32), experts = Tensor::empty({M, k}, DType::i32),
         weights = Tensor::empty({M, k}, DType::f32), none;
  Tensor wrong_probs = Tensor::empty({M, E + 1}, DType::f32);
  test::expect_error(
      [&] { ops::moe_route(logits, none, false, wrong_probs, experts, weights, none); },
      {"moe_route", "probs", "[4, 3]", "[4, 4]"});
  Tensor f32_experts = Tensor::empty({M, k}, DType::f32);
  test::expect_error(
      [&] { ops::moe_route(logits, none, false, probs, f32_experts, weights, none); },
      {"moe_route", "experts", "int32"});
  Tensor four = Tensor::empty({M, 4}, DType::i32), w4 = Tensor::empty({M, 4}, DType::f32);
  test::expect_error([&] { ops::moe_route(logits, none, false, probs, four, w4, none); },
                     {"moe_route", "k = 4", "E = 3"});
  const Tensor short_bias = random({E - 1}, 61);
  test::expect_error(
      [&] { ops::moe_route(logits, short_bias, false, probs, experts, weights, none); },
      {"moe_route", "bias", "[3]"});
  test::expect_error(
      [&] { ops::moe_route_backward(probs, experts, weights, probs, false, none, probs); },
      {"moe_route_backward", "dweights", "[4, 2]"});
  test::expect_error([&] { ops::moe_permute(experts, 0, 0); }, {"moe_permute", "E must be > 0"});
  test::expect_error([&] { ops::moe_permute(experts, E, -2); }, {"moe_permute", "capacity", "-2"});
  const std::vector<int64_t> short_caps(size_t(E - 1), 4);
  test::expect_error([&] { ops::moe_permute(experts, E, short_caps); },
                     {"moe_permute", std::to_string(E - 1) + " capacities", "one per expert"});
  test::expect_error([&] { ops::moe_permute(f32_experts, E, 0); }, {"moe_permute", "int32"});

  ops::moe_route(logits, none, false, probs, experts, weights, none);
  const ops::MoePermutation p = ops::moe_permute(experts, E, 0);
  const Tensor x = random({M, d}, 62);
  Tensor xs16 = Tensor::empty({M * k, d}, DType::bf16), xs = Tensor::empty({M * k, d}, DType::f32);
  test::expect_error([&] { ops::moe_dispatch(x, p.order, k, xs16); },
                     {"moe_dispatch", "xs", "float32", "bfloat16"});
  test::expect_error(
      [&] {
        ops::moe_dispatch(x, p.pos.view({M, k}), k, xs);
      },
      {"moe_dispatch", "order", "1-d"});
  test::expect_error([&] { ops::moe_dispatch(x, p.order, 0, xs); }, {"moe_dispatch", "k"});
  Tensor y = Tensor::zeros({M, d}, DType::f32), y16 = Tensor::empty({M, d}, DType::bf16);
  test::expect_error([&] { ops::moe_combine(xs, weights, p.order.narrow(0, 0, 3), y); },
                     {"moe_combine", "pos", "[8]", "[3]"});
  test::expect_error([&] { ops::moe_combine(xs, weights, p.pos, y16); },
                     {"moe_combine", "y", "float32"});
  Tensor narrow_ys = Tensor::empty({M * k, d - 1}, DType::f32);
  test::expect_error([&] { ops::moe_combine(narrow_ys, weights, p.pos, y); },
                     {"moe_combine", "one width"});
  Tensor dw = Tensor::empty({M, k}, DType::f32), dys = Tensor::empty({M * k + 1, d}, DType::f32);
  test::expect_error([&] { ops::moe_combine_backward(y, xs, weights, p.pos, dys, dw); },
                     {"moe_combine_backward", "dys", "[8, 5]", "[9, 5]"});
  Tensor dx = Tensor::empty({M + 1, d}, DType::f32);
  test::expect_error([&] { ops::moe_dispatch_backward(xs, p.pos, k, dx, false); },
                     {"moe_dispatch_backward", "pos", "[10]"});
  Tensor on_meta = meta({M, d});
  test::expect_error([&] { ops::moe_combine(xs, weights, p.pos, on_meta); },
                     {"moe_combine", "cpu", "meta"});

  std::vector<Tensor> w = {random({3, d}, 63), random({3, d}, 64)};
  Tensor ys = Tensor::empty({M * k, 3}, DType::f32);
  const std::vector<int64_t> bad_sum = {3, 4}, three = {4, 2, 2}, neg = {9, -1};
  test::expect_error([&] { ops::grouped_linear(xs, w, bad_sum, ys); },
                     {"grouped_linear", "x", "7 rows", "[8, 5]"});
  test::expect_error([&] { ops::grouped_linear(xs, w, three, ys); },
                     {"grouped_linear", "2 expert weights for 3 counts"});
  test::expect_error([&] { ops::grouped_linear(xs, w, neg, ys); },
                     {"grouped_linear", "expert 1", "negative"});
  std::vector<Tensor> w_cols = {random({3, d}, 63), random({3, d + 1}, 64)};
  const std::vector<int64_t> ok = {4, 4};
  test::expect_error([&] { ops::grouped_linear(xs, w_cols, ok, ys); },
                     {"grouped_linear", "expert 1's weight", "5 columns"});
  std::vector<ops::WeightGrad> one_grad = {ops::WeightGrad(random({3, d}, 65))};
  test::expect_error([&] { ops::grouped_linear_backward(ys, xs, w, ok, one_grad, xs); },
                     {"grouped_linear_backward", "1 weight gradients for 2 experts"});
}

// On meta: no indices, so the rows are spread evenly (the first N % E experts one more), capped
// by the capacity; pos and order are booked; every op reports its work and computes nothing (the
// meta pointers are never dereferenced: a kernel call would crash).
TEST(MoeOps, MetaPermutesBalancedAndComputesNothing) {
  const int64_t M = 10, k = 2, E = 3, K = 8, F = 6;
  Tensor experts = meta({M, k}, DType::i32);
  auto& alloc = Allocator::get(Device::meta);
  const size_t before = alloc.stats().allocated;
  ops::MoePermutation p = ops::moe_permute(experts, E, 0);
  EXPECT_EQ(p.counts, (std::vector<int64_t>{7, 7, 6}));
  EXPECT_EQ(p.rows(), 20);
  EXPECT_EQ(p.dropped, 0);
  EXPECT_EQ(p.pos.numel(), 20);
  EXPECT_EQ(p.order.numel(), 20);
  EXPECT_EQ(p.order.device(), Device::meta);
  EXPECT_EQ(p.pos.dtype(), DType::i32);
  EXPECT_GE(alloc.stats().allocated - before, size_t(40 * 4));
  const ops::MoePermutation capped = ops::moe_permute(experts, E, 5);
  EXPECT_EQ(capped.counts, (std::vector<int64_t>{5, 5, 5}));
  EXPECT_EQ(capped.dropped, 5);
  EXPECT_EQ(capped.order.numel(), 15);
  // A capacity per expert caps each expert's even share by its own.
  const std::vector<int64_t> each = {2, 9, 6};
  const ops::MoePermutation own = ops::moe_permute(experts, E, each);
  EXPECT_EQ(own.counts, (std::vector<int64_t>{2, 7, 6}));
  EXPECT_EQ(own.dropped, 5);
  EXPECT_EQ(own.order.numel(), 15);

  std::vector<std::string> ops_seen;
  {
    ops::RecordWork record([&](const ops::KernelWork& w) {
      ops_seen.push_back(w.op);
      EXPECT_GT(w.bytes, 0) << w.op;
    });
    Tensor logits = meta({M, E}), weights = meta({M, k}), prob_sum = meta({E});
    ops::moe_route(logits, Tensor(), true, logits, experts, weights, prob_sum);
    ops::moe_route_backward(logits, experts, weights, weights, true, prob_sum, logits);
    p = ops::moe_permute(experts, E, 0);
    const int64_t N = p.rows();
    Tensor x = meta({M, K}), xs = meta({N, K}), ys = meta({N, F}), y = meta({M, F});
    ops::moe_dispatch(x, p.order, k, xs);
    std::vector<Tensor> w = {meta({F, K}), meta({F, K}), meta({F, K})};
    ops::grouped_linear(xs, w, p.counts, ys);
    ops::moe_combine(ys, weights, p.pos, y);
    Tensor dys = meta({N, F}, DType::bf16), dxs = meta({N, K});
    ops::moe_combine_backward(y, ys, weights, p.pos, dys, weights);
    std::vector<ops::WeightGrad> dw(w.begin(), w.end());
    ops::grouped_linear_backward(meta({N, F}), xs, w, p.counts, dw, dxs);
    ops::moe_dispatch_backward(dxs, p.pos, k, x, true);
  }
  const std::vector<std::string> want = {"moe_route",
                                         "moe_route_backward",
                                         "moe_permute",
                                         "moe_dispatch",
                                         "linear",
                                         "linear",
                                         "linear",
                                         "moe_combine",
                                         "moe_combine_backward",
                                         "linear_backward",
                                         "linear_backward_weight",
                                         "linear_backward",
                                         "linear_backward_weight",
                                         "linear_backward",
                                         "linear_backward_weight",
                                         "moe_dispatch_backward"};
  EXPECT_EQ(ops_seen, want);
}

// A rank whose experts got no token (expert or tensor parallelism over few experts): the experts'
// path runs on zero rows, writes nothing and leaves the weights' gradients as they were.
TEST(MoeOps, ARankWithoutRowsComputesNothing) {
  const int64_t K = 6, F = 4, d = 5;
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const std::vector<int64_t> counts = {0, 0};
    const Tensor xs = Tensor::empty({0, K}, dt);
    std::vector<Tensor> w{ops::to_compute(random({2 * F, K}, 60), dt),
                          ops::to_compute(random({2 * F, K}, 61), dt)};
    Tensor gu = Tensor::empty({0, 2 * F}, dt), act = Tensor::empty({0, F}, dt);
    ops::grouped_linear(xs, w, counts, gu);
    ops::swiglu_forward(gu, act);
    const Tensor dact = Tensor::empty({0, F}, DType::f32);
    ops::swiglu_backward(dact, gu, gu);
    Tensor g0 = random({2 * F, K}, 62), g1 = random({2 * F, K}, 63);
    const std::vector<float> before = values(g0);
    std::vector<ops::WeightGrad> grads{ops::WeightGrad(g0), ops::WeightGrad(g1)};
    Tensor dxs = Tensor::empty({0, K}, DType::f32);
    ops::grouped_linear_backward(gu, xs, w, counts, grads, dxs);
    EXPECT_TRUE(same_bits(values(g0), before));
    // Every token's choices are another rank's: the combine adds nothing.
    const int64_t M = 3, k = 2;
    Tensor pos = Tensor::empty({M * k}, DType::i32);
    for (int64_t i = 0; i < M * k; ++i) pos.data<int32_t>()[i] = -1;
    const Tensor weights = random({M, k}, 64), ys = Tensor::empty({0, d}, dt);
    Tensor y = random({M, d}, 65);
    const std::vector<float> y_before = values(y);
    ops::moe_combine(ys, weights, pos, y);
    EXPECT_TRUE(same_bits(values(y), y_before));
  }
}
