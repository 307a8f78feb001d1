// The training step of a mixture of experts with the auxiliary-loss-free bias (train/step.hpp,
// model/moe_balance.hpp): AdamW steps the weights and leaves the bias alone (no gradient, no
// weight decay), then the model moves the bias by the rule alone; a runaway router's warning
// reaches StepResult::notes.
#include <gtest/gtest.h>

#include "model/moe.hpp"
#include "parallel/parallelize.hpp"
#include "tests/model/tiny_moe.hpp"
#include "tests/test_util.hpp"
#include "train/optimizer.hpp"
#include "train/step.hpp"

using namespace loom;

namespace {

// Mixtral-shaped: two sparse layers of 4 experts, top-2, with the bias.
MoeConfig tiny(double rate) {
  using F = MoeConfig::Family;
  MoeConfig c =
      test::TinyMoe{.family = F::mixtral, .layers = 2, .kv_heads = 4, .experts = 4, .vocab = 61}
          .config();
  c.expert_bias = true;
  c.training.bias_update_rate = rate;
  return c;
}

std::vector<float> values(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

}  // namespace

TEST(MoeStep, AdamWLeavesTheBiasToItsRule) {
  const float rate = 0.25f;  // large, so that an optimizer's touch would show against it
  ParallelModel par = parallelize(tiny(rate), DType::f32, ParallelGroups{}, ParallelizeOptions{});
  par.model->init_weights(5);
  AdamW adamw(par.model->units(), AdamWConfig{0.05f, 0.9f, 0.95f, 1e-8f, 0.5f});
  TrainStep step(par, adamw, 1.0, 2 * 16);
  MicroBatch mb{2, 16, test::random_tokens(32, 61, 1), test::random_tokens(32, 61, 2)};
  const auto& moe = static_cast<const MoeModel&>(*par.model);
  std::vector<std::pair<Param*, Param*>> bias_and_router;  // per layer
  for (ParamUnit* u : par.model->units())
    for (Param& p : u->params())
      if (p.spec.name.ends_with("gate.e_score_correction_bias"))
        bias_and_router.emplace_back(&p, &u->params()[u->params().size() - 2]);
  ASSERT_EQ(bias_and_router.size(), 2u);
  ASSERT_TRUE(bias_and_router[0].second->spec.name.ends_with("block_sparse_moe.gate.weight"));
  for (int s = 0; s < 3; ++s) {
    const std::vector<float> router = values(bias_and_router[0].second->value);
    std::vector<std::vector<float>> before;
    for (auto [b, r] : bias_and_router) before.push_back(values(b->value));
    const StepResult res = step.run(
        1, [&](int64_t) -> const MicroBatch& { return mb; }, 0.05);
    ASSERT_TRUE(res.updated);
    EXPECT_NE(values(bias_and_router[0].second->value), router);  // AdamW ran
    const std::vector<double>& loads = moe.balance().step_loads();
    for (size_t l = 0; l < 2; ++l) {
      const double mean = 16.0;  // 32 tokens x 2 choices over 4 experts
      const std::vector<float> now = values(bias_and_router[l].first->value);
      for (size_t e = 0; e < 4; ++e) {
        const double n = loads[l * 4 + e];
        const float d = n < mean ? rate : n > mean ? -rate : 0.0f;
        EXPECT_EQ(now[e], before[l][e] + d) << "step " << s << " layer " << l << " expert " << e;
      }
    }
  }
}

// The warning of a router sending every token to one expert, from the step (the trainer prints
// StepResult::notes on rank 0).
TEST(MoeStep, RunawayRouterWarningIsAStepNote) {
  ParallelModel par = parallelize(tiny(0), DType::f32, ParallelGroups{}, ParallelizeOptions{});
  par.model->init_weights(5);
  for (ParamUnit* u : par.model->units())
    for (Param& p : u->params())
      if (p.spec.name.ends_with("gate.e_score_correction_bias")) p.value.data<float>()[2] = 5;
  AdamW adamw(par.model->units(), AdamWConfig{});
  TrainStep step(par, adamw, 1.0, 32);
  MicroBatch mb{2, 16, test::random_tokens(32, 61, 1), test::random_tokens(32, 61, 2)};
  const StepResult r = step.run(
      1, [&](int64_t) -> const MicroBatch& { return mb; }, 1e-3);
  ASSERT_EQ(r.notes.size(), 2u);
  EXPECT_NE(r.notes[1].find("layer 1's router is running away: expert 2 got 32 of the step's 32"),
            std::string::npos)
      << r.notes[1];
}
