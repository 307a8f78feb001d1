// The output head both families share (model/head.hpp) on one rank: the plan says whether the
// projection is vocabulary-parallel (a row-parallel entry is refused), every plan and precision
// gives the same bits in f32 (where they are the same numerics), a tied head writes the
// embedding's gradient with the untied bits, and the loss and input gradient agree with an fp64
// reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "distributed/buffer_pool.hpp"
#include "model/gla_plan.hpp"
#include "model/head.hpp"
#include "model/llama_plan.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

constexpr int64_t M = 24, d = 16, V = 37;
constexpr float kEps = 1e-5f;

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

struct HeadRun {
  double loss = 0;
  std::vector<float> dx, norm_grad, out_grad;
};

// The head on random inputs: `tied` reads the embedding's table (set to the untied head's
// weights, so both compute the same thing).
HeadRun run_head(std::span<const PlanEntry> plan, BranchPrecision precision, bool tied) {
  std::vector<ParamSpec> specs(1), table(1);
  specs[0].name = "model.norm.weight";
  specs[0].shape = {d};
  specs[0].init = Init::ones;
  specs[0].f32_value = true;
  table[0].name = plan[0].pattern;  // both plans list the embedding first
  table[0].shape = {V, d};
  if (!tied) {
    specs.push_back(table[0]);
    specs.back().name = "lm_head.weight";
  }
  ParamUnit head("head", specs, false, Device::cpu);
  ParamUnit embed("embed", table, false, Device::cpu);
  head.init_weights(1);
  embed.init_weights(2);
  // Norm weights away from 1, the same projection whichever unit holds it.
  const std::vector<float> g = test::randn(size_t(d), 3, 0.2f), w = test::randn(size_t(V * d), 4);
  float* norm = head.params()[0].value.data<float>();
  for (int64_t i = 0; i < d; ++i) norm[i] = 1 + g[size_t(i)];
  Tensor& out = tied ? embed.params()[0].value : head.params()[1].value;
  std::memcpy(out.data<float>(), w.data(), w.size() * sizeof(float));
  head.zero_grad();
  embed.zero_grad();
  Tensor x = Tensor::empty({M, d}, DType::f32);
  const std::vector<float> xv = test::randn(size_t(M * d), 5);
  std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
  const std::vector<int32_t> targets = test::random_tokens(M, V, 6);
  dist::BufferPool pool;
  const TpRuntime tp{TpOptions{}, &pool};
  const LossHead h{.tp = tp,
                   .plan = plan,
                   .precision = precision,
                   .tied = tied,
                   .M = M,
                   .Mx = M,
                   .d = d,
                   .vocab = V,
                   .eps = kEps,
                   .compute = DType::f32,
                   .chunk_rows = 16};
  HeadRun r;
  const Tensor loss = Tensor::empty({1}, DType::f64);
  r.dx = values(h.forward_backward(head, embed, x,
                                   ops::index_tensor(targets, Device::cpu, "target"), 0.5f, loss));
  r.loss = loss.data<double>()[0];
  r.norm_grad = values(head.params()[0].grad);
  r.out_grad = values(tied ? embed.params()[0].grad : head.params()[1].grad);
  return r;
}

void expect_same_bits(const HeadRun& a, const HeadRun& b) {
  EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(double)), 0) << a.loss << " vs " << b.loss;
  using Field = std::vector<float> HeadRun::*;
  for (Field f : {&HeadRun::dx, &HeadRun::norm_grad, &HeadRun::out_grad}) {
    ASSERT_EQ((a.*f).size(), (b.*f).size());
    EXPECT_EQ(std::memcmp((a.*f).data(), (b.*f).data(), (a.*f).size() * sizeof(float)), 0);
  }
}

}  // namespace

TEST(LossHead, PlanSaysWhetherTheProjectionIsVocabularyParallel) {
  EXPECT_TRUE(vocab_parallel_output(llama_plan(), "lm_head.weight"));
  EXPECT_TRUE(vocab_parallel_output(llama_plan(), "model.embed_tokens.weight"));  // tied
  EXPECT_FALSE(vocab_parallel_output(gla_plan(), "lm_head.weight"));
  EXPECT_FALSE(vocab_parallel_output(gla_plan(), "model.embeddings.weight"));  // tied
  static constexpr PlanEntry row[] = {{"lm_head.weight", TpStyle::row}};
  test::expect_error([] { vocab_parallel_output(row, "lm_head.weight"); },
                     {"lm_head.weight", "row-parallel"});
  test::expect_error([] { vocab_parallel_output(row, "model.embed_tokens.weight"); },
                     {"model.embed_tokens.weight", "no entry"});
}

// On one rank the vocabulary-parallel loss is the single-rank one, and in f32 both precisions
// compute the same values (only their buffers' order differs).
TEST(LossHead, PlansAndPrecisionsGiveTheSameBitsInF32) {
  const HeadRun base = run_head(llama_plan(), BranchPrecision::rounded_outputs, false);
  expect_same_bits(run_head(llama_plan(), BranchPrecision::f32_outputs, false), base);
  expect_same_bits(run_head(gla_plan(), BranchPrecision::rounded_outputs, false), base);
  expect_same_bits(run_head(gla_plan(), BranchPrecision::f32_outputs, false), base);
}

TEST(LossHead, TiedWritesTheEmbeddingsGradientWithTheUntiedBits) {
  expect_same_bits(run_head(llama_plan(), BranchPrecision::rounded_outputs, true),
                   run_head(llama_plan(), BranchPrecision::rounded_outputs, false));
  expect_same_bits(run_head(gla_plan(), BranchPrecision::f32_outputs, true),
                   run_head(gla_plan(), BranchPrecision::f32_outputs, false));
}

// loss = sum_i lse(W xn_i) - (W xn_i)[t_i], xn = rmsnorm(x) g; dx through both, in fp64.
TEST(LossHead, AgreesWithAnFp64Reference) {
  const HeadRun got = run_head(gla_plan(), BranchPrecision::f32_outputs, false);
  const std::vector<double> g0 = test::to_double(test::randn(size_t(d), 3, 0.2f)),
                            w = test::to_double(test::randn(size_t(V * d), 4)),
                            x0 = test::to_double(test::randn(size_t(M * d), 5));
  const std::vector<int32_t> t = test::random_tokens(M, V, 6);
  auto loss = [&](const std::vector<double>& x) {
    double sum = 0;
    for (int64_t i = 0; i < M; ++i) {
      double ms = 0;
      for (int64_t k = 0; k < d; ++k) ms += x[size_t(i * d + k)] * x[size_t(i * d + k)];
      const double rstd = 1 / std::sqrt(ms / double(d) + double(kEps));
      std::vector<double> logit(size_t(V), 0.0);
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        for (int64_t k = 0; k < d; ++k)
          logit[size_t(v)] +=
              w[size_t(v * d + k)] * x[size_t(i * d + k)] * rstd * (1 + g0[size_t(k)]);
        mx = std::max(mx, logit[size_t(v)]);
      }
      double se = 0;
      for (double l : logit) se += std::exp(l - mx);
      sum += mx + std::log(se) - logit[size_t(t[size_t(i)])];
    }
    return sum;
  };
  EXPECT_NEAR(got.loss, loss(x0), 1e-5 * std::abs(loss(x0)));
  std::vector<double> dx = test::numeric_grad(loss, x0);
  for (double& v : dx) v *= 0.5;  // grad_scale
  EXPECT_LT(test::rel_l2(got.dx, dx), 1e-4);
}
