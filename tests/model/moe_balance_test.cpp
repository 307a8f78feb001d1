// The experts' capacity, DeepSeek-V3's auxiliary-loss-free bias and the runaway-router warning of
// a mixture of experts (model/moe_capacity.hpp, model/moe_balance.hpp; docs/decisions/moe.md), on
// the model: what a capacity drops under context parallelism against one process, the bias's step
// rule and its effect on the loads, and a router that sends every token to one expert.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>

#include "core/philox.hpp"
#include "model/moe.hpp"
#include "model/moe_capacity.hpp"
#include "model/safetensors.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "tests/model/tiny_moe.hpp"
#include "tests/support/thread_process_group.hpp"
#include "tests/temp_dir.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// Qwen3-MoE-shaped and small: a dense first layer, two sparse ones of 8 experts, top-2.
MoeConfig tiny() {
  MoeConfig c = test::TinyMoe{}.config();
  c.mlp_only_layers = {0};
  return c;
}

constexpr int64_t kB = 4, kT = 32, kM = kB * kT;

// One micro-batch of tokens, the same every step.
struct Batch {
  std::vector<int32_t> in, tg;
  Batch() {
    const std::vector<int32_t> t = test::random_tokens(kB * (kT + 1), 97, 5);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t s = 0; s < kT; ++s) {
        in.push_back(t[size_t(b * (kT + 1) + s)]);
        tg.push_back(t[size_t(b * (kT + 1) + s + 1)]);
      }
  }
};

// A step without an optimizer (the weights stay: only the bias moves): forward and backward of
// the batch, the step's window closed, then what the model does after an update. Returns its
// lines and the metrics.
struct StepOut {
  std::vector<std::string> lines;
  std::vector<ModelMetric> metrics;
};
StepOut step(MoeModel& m, const Batch& b) {
  m.zero_grad();
  m.forward_backward(b.in.data(), b.tg.data(), kB, kT, 1.0f / float(kM));
  StepOut out;
  out.metrics = m.take_step_metrics();
  out.lines = m.after_update(nullptr, nullptr);
  return out;
}

double metric(const StepOut& s, const std::string& name) {
  for (const ModelMetric& m : s.metrics)
    if (m.name == name) return m.value;
  ADD_FAILURE() << "no metric " << name;
  return 0;
}

// The worst sparse layer's load max/mean in the last step.
double worst_load(const MoeModel& m) {
  const std::vector<double>& n = m.balance().step_loads();
  const size_t E = size_t(m.config().num_experts);
  double worst = 0;
  for (size_t l = 0; l * E < n.size(); ++l) {
    const double total = std::accumulate(n.begin() + long(l * E), n.begin() + long(l * E + E), 0.0);
    worst =
        std::max(worst, *std::max_element(n.begin() + long(l * E), n.begin() + long(l * E + E)) *
                            double(E) / total);
  }
  return worst;
}

// Every sparse layer's bias: (unit, index).
std::vector<std::pair<ParamUnit*, size_t>> biases(MoeModel& m) {
  std::vector<std::pair<ParamUnit*, size_t>> out;
  for (ParamUnit* u : m.units())
    for (size_t i = 0; i < u->params().size(); ++i)
      if (u->params()[i].spec.name.ends_with("mlp.gate.e_score_correction_bias"))
        out.emplace_back(u, i);
  return out;
}

std::vector<float> values(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

}  // namespace

// Megatron's get_capacity on the micro-batch's tokens x k choices: ceil((tokens x k / E) x f).
TEST(MoeBalance, CapacityRule) {
  EXPECT_EQ(expert_capacity(0, 128, 2, 8), 0);  // dropless
  EXPECT_EQ(expert_capacity(1.0, 128, 2, 8), 32);
  EXPECT_EQ(expert_capacity(1.25, 128, 2, 8), 40);
  EXPECT_EQ(expert_capacity(1.1, 100, 2, 8), 28);  // 27.5 up
  EXPECT_EQ(expert_capacity(1e-9, 128, 2, 8), 1);  // never 0 with a factor
  EXPECT_EQ(expert_capacity(1.0, 2048 * 4, 8, 128), 512);
}

// Under context parallelism each cp rank keeps, of every expert, exactly the choices one process
// keeps of the whole micro-batch (the first `capacity` in token order), whatever the zigzag
// layout puts where; the dropped choices over the ranks are the one process's.
TEST(MoeBalance, CpCapacitiesDropWhatOneProcessDrops) {
  const int64_t B = 3, T = 24, E = 6, k = 2;
  // Skewed choices, so that several experts overflow.
  std::vector<int32_t> all(size_t(B * T * k));
  std::vector<float> u(all.size());
  philox_uniform(philox_key(4, "cp.capacity"), 0, int64_t(u.size()), u.data());
  for (size_t i = 0; i < all.size(); ++i) all[i] = int32_t(float(E) * u[i] * u[i]) % int32_t(E);
  for (int64_t t = 0; t < B * T; ++t)  // two distinct experts per token
    if (all[size_t(t * k)] == all[size_t(t * k + 1)])
      all[size_t(t * k + 1)] = (all[size_t(t * k)] + 1) % int32_t(E);
  const int64_t capacity = expert_capacity(1.0, B * T, k, E);
  Tensor whole = Tensor::empty({B * T, k}, DType::i32);
  std::copy(all.begin(), all.end(), whole.data<int32_t>());
  const ops::MoePermutation one = ops::moe_permute(whole, E, capacity);
  ASSERT_GT(one.dropped, 0);
  for (int cp : {2, 3}) {
    std::vector<int64_t> dropped(size_t(cp), 0);
    test::run_ranks(cp, [&](test::ThreadProcessGroup& g) {
      const int r = g.rank();
      StepContext ctx;
      ctx.B = B;
      ctx.T = T / cp;
      for (int s = 0; s < cp; ++s) ctx.cp_pos.push_back(cp_positions(T, cp, s, 1));
      const std::vector<int64_t>& pos = ctx.cp_pos[size_t(r)];
      Tensor mine = Tensor::empty({B * ctx.T, k}, DType::i32);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < ctx.T; ++t)
          for (int64_t j = 0; j < k; ++j)
            mine.data<int32_t>()[(b * ctx.T + t) * k + j] =
                all[size_t((b * T + pos[size_t(t)]) * k + j)];
      const ops::MoePermutation p =
          ops::moe_permute(mine, E, cp_capacities(g, ctx, mine, E, capacity));
      dropped[size_t(r)] = p.dropped;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < ctx.T; ++t)
          for (int64_t j = 0; j < k; ++j) {
            const bool kept = p.pos.data<int32_t>()[(b * ctx.T + t) * k + j] >= 0;
            const bool want = one.pos.data<int32_t>()[(b * T + pos[size_t(t)]) * k + j] >= 0;
            EXPECT_EQ(kept, want) << "cp " << cp << " rank " << r << " sample " << b << " position "
                                  << pos[size_t(t)] << " choice " << j;
          }
    });
    EXPECT_EQ(std::accumulate(dropped.begin(), dropped.end(), int64_t{0}), one.dropped) << cp;
  }
}

// On meta nothing is routed: the same collective runs and each rank takes an even share.
TEST(MoeBalance, CpCapacitiesOnMetaAreAnEvenShare) {
  test::run_ranks(2, [&](test::ThreadProcessGroup& g) {
    StepContext ctx;
    ctx.B = 2;
    ctx.T = 8;
    for (int s = 0; s < 2; ++s) ctx.cp_pos.push_back(cp_positions(16, 2, s, 1));
    const Tensor experts = Tensor::empty({16, 2}, DType::i32, Device::meta);
    EXPECT_EQ(cp_capacities(g, ctx, experts, 4, 9), (std::vector<int64_t>{5, 5, 5, 5}));
  });
}

// b_e += rate x sign(mean load - load_e) after each step, from the step's loads; with the
// weights fixed (no optimizer) the loads without the bias stay where the router put them, and
// with it they fall toward the mean.
TEST(MoeBalance, BiasMovesLoadsTowardBalance) {
  const Batch batch;
  const double rate = 1e-3;
  const int steps = 40;
  std::vector<double> without, with;
  for (const bool on : {false, true}) {
    MoeConfig c = tiny();
    c.expert_bias = on;
    c.training.bias_update_rate = on ? rate : 0;
    MoeModel m(c, DType::f32);
    m.init_weights(3);
    std::vector<double>& loads = on ? with : without;
    for (int s = 0; s < steps; ++s) {
      const std::vector<std::vector<float>> before = [&] {
        std::vector<std::vector<float>> v;
        for (auto [u, i] : biases(m)) v.push_back(values(u->params()[i].value));
        return v;
      }();
      step(m, batch);
      loads.push_back(worst_load(m));
      if (!on) continue;
      // The rule, from the loads the step counted (one process: the micro-batch's).
      const std::vector<double>& n = m.balance().step_loads();
      const auto bs = biases(m);
      ASSERT_EQ(bs.size(), 2u);
      for (size_t l = 0; l < bs.size(); ++l) {
        const std::vector<float> now = values(bs[l].first->params()[bs[l].second].value);
        const double mean = double(kM * c.num_experts_per_tok) / double(c.num_experts);
        for (size_t e = 0; e < now.size(); ++e) {
          const double load = n[l * 8 + e];
          const float d = load < mean ? float(rate) : load > mean ? -float(rate) : 0.0f;
          ASSERT_EQ(now[e], before[l][e] + d) << "step " << s << " layer " << l << " expert " << e;
        }
      }
    }
  }
  for (double w : without) EXPECT_EQ(w, without[0]);  // nothing else moves the routing
  const double last = std::accumulate(with.end() - 10, with.end(), 0.0) / 10;
  std::printf(
      "worst layer's load max/mean: without the bias %.3f every step; with it (rate %g) "
      "%.3f at step 1, %.3f over steps %d-%d\n",
      without[0], rate, with[0], last, steps - 9, steps);
  EXPECT_GT(without[0], 1.3);  // the random router is unbalanced enough to show the effect
  EXPECT_LT(last, 1.0 + 0.5 * (without[0] - 1.0));
}

// A bias run away (+10 on expert 0 of every sparse layer: every token chooses it first): the
// step finishes, the log gets one warning per layer naming the expert and the share, held while
// it lasts and a note when it is back under; with a capacity the drops are what the loads say
// (every expert's choices past C = ceil(tokens x k / E)), dropless none.
TEST(MoeBalance, RunawayRouterWarnsAndCountsDrops) {
  const Batch batch;
  for (const double factor : {1.0, 0.0}) {
    MoeConfig c = tiny();
    c.expert_bias = true;
    c.training.capacity_factor = factor;
    MoeModel m(c, DType::f32);
    m.init_weights(3);
    std::vector<float> push(8, 0.0f);
    push[0] = 10;
    for (auto [u, i] : biases(m)) add_to_param(*u, i, push);
    const StepOut s1 = step(m, batch);
    ASSERT_EQ(s1.lines.size(), 2u);
    for (int64_t l : {1, 2}) {
      const std::string& line = s1.lines[size_t(l - 1)];
      EXPECT_NE(line.find(str_cat("layer ", l,
                                  "'s router is running away: expert 0 got 128 of "
                                  "the step's 128 tokens (load max/mean 4 >= 2.5")),
                std::string::npos)
          << line;
      EXPECT_NE(line.find(factor > 0 ? "dropped" : "dropless"), std::string::npos) << line;
    }
    const int64_t C = expert_capacity(factor, kM, 2, 8);
    double over = 0;
    for (double n : m.balance().step_loads()) over += C > 0 ? std::max(0.0, n - double(C)) : 0;
    EXPECT_EQ(metric(s1, "dropped"), over / double(2 * kM * 2));
    if (factor > 0) {
      EXPECT_GE(metric(s1, "dropped"), 2 * 96.0 / 512);  // expert 0's 128 - 32 at least, per layer
    }
    EXPECT_EQ(metric(s1, "expert_load"), 4.0);  // the router's choices, dropped or not
    std::printf("capacity factor %g: dropped %.4f of the choices, warned: %s\n", factor,
                metric(s1, "dropped"), s1.lines[0].c_str());
    EXPECT_TRUE(step(m, batch).lines.empty());  // held while it lasts
    push[0] = -10;
    for (auto [u, i] : biases(m)) add_to_param(*u, i, push);
    const StepOut s3 = step(m, batch);
    ASSERT_EQ(s3.lines.size(), 2u);
    EXPECT_NE(s3.lines[0].find("layer 1's load max/mean is back under 2.5"), std::string::npos)
        << s3.lines[0];
  }
}

// moe.load_warning moves the threshold: 1.01 reports an ordinary random router.
TEST(MoeBalance, LoadWarningKeyIsTheThreshold) {
  MoeConfig c = tiny();
  EXPECT_EQ(c.load_warning_threshold(), 2.5);  // (1 + E/k) / 2
  c.training.load_warning = 1.01;
  EXPECT_EQ(c.load_warning_threshold(), 1.01);
  MoeModel m(c, DType::f32);
  m.init_weights(3);
  const StepOut s = step(m, Batch());
  ASSERT_FALSE(s.lines.empty());
  EXPECT_NE(s.lines[0].find(">= 1.01, moe.load_warning"), std::string::npos) << s.lines[0];
}

// A directory without the biases (a Hugging Face Qwen3-MoE's) loads into a model with them: the
// biases start at zero, every other tensor as the file has it; a model's config.json says it has
// them ("loom_expert_bias"), and a reader builds them from it.
TEST(MoeBalance, LoadHfStartsAMissingBiasAtZero) {
  test::TempDir dir;
  MoeConfig plain = tiny();
  MoeModel from(plain, DType::f32);
  from.init_weights(8);
  std::vector<NamedTensor> w;
  for (ParamUnit* u : from.units())
    for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
  write_safetensors(dir / "model.safetensors", w);
  MoeConfig c = tiny();
  c.expert_bias = true;
  MoeModel m(c, DType::f32);
  m.init_weights(1);
  for (auto [u, i] : biases(m)) add_to_param(*u, i, std::vector<float>(8, 0.5f));
  m.load_hf(SafetensorsDir(dir.path().string()));
  for (auto [u, i] : biases(m))
    for (float v : values(u->params()[i].value)) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(values(m.units()[1]->params()[1].value), values(from.units()[1]->params()[1].value));
  EXPECT_EQ(c.num_params(), plain.num_params() + 2 * 8);
  EXPECT_EQ(m.num_params(), c.num_params());
  const MoeConfig back = MoeConfig::from_json(c.to_json(), "config.json");
  EXPECT_TRUE(back.expert_bias);
  EXPECT_FALSE(MoeConfig::from_json(plain.to_json(), "config.json").expert_bias);
  EXPECT_EQ(plain.to_json().find("loom_expert_bias"), std::string::npos);
}
