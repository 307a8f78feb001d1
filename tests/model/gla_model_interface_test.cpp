// GlaModel through the Model interface (model/model.hpp): the hooks around each unit in the
// order LlamaModel calls them, forward/backward over unit ranges giving the bits of one
// forward_backward, a sharded model refusing to run without hooks, and the cost oracle's saved
// activations (tests/support/model_cost.hpp) against what a step saves.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "model/gla.hpp"
#include "model/llama.hpp"
#include "model/model_config.hpp"
#include "tests/support/model_cost.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

GlaConfig small(bool conv, bool tied) {
  GlaConfig c;
  c.hidden_size = 64;
  c.num_hidden_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 96;
  c.vocab_size = 101;
  c.use_short_conv = conv;
  c.tie_word_embeddings = tied;
  return c;
}

LlamaConfig small_llama(bool tied) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 101;
  c.tie_word_embeddings = tied;
  return c;
}

struct Recorder : UnitHooks {
  std::vector<std::string> calls;
  void before_forward(size_t u) override { calls.push_back("bf" + std::to_string(u)); }
  void after_forward(size_t u) override { calls.push_back("af" + std::to_string(u)); }
  void before_backward(size_t u) override { calls.push_back("bb" + std::to_string(u)); }
  void after_backward(size_t u) override { calls.push_back("ab" + std::to_string(u)); }
};

std::vector<std::vector<float>> grads(Model& m) {
  std::vector<std::vector<float>> out;
  for (ParamUnit* u : m.units()) {
    const float* g = u->grad_flat().data<float>();
    out.emplace_back(g, g + u->numel());
  }
  return out;
}

}  // namespace

TEST(GlaModelInterface, HooksInLlamasOrder) {
  const int64_t B = 2, T = 16;
  const auto tok = test::random_tokens(B * T + 1, 101, 3);
  auto calls = [&](Model& m) {
    m.init_weights(1);
    Recorder r;
    m.set_hooks(&r);
    m.forward_backward(tok.data(), tok.data() + 1, B, T, 0.1f);
    m.set_hooks(nullptr);
    return r.calls;
  };
  for (bool tied : {false, true}) {
    GlaModel gla(small(false, tied), DType::f32);
    LlamaModel llama(small_llama(tied), DType::f32);
    const auto g = calls(gla);
    EXPECT_EQ(g, calls(llama));
    // Every unit forward in order, the head's forward straight into its backward, then back.
    ASSERT_EQ(g.size(), 4 * gla.num_units());
    EXPECT_EQ(g.front(), "bf0");
    EXPECT_EQ(g[2 * gla.num_units() - 1], "af4");
    EXPECT_EQ(g[2 * gla.num_units()], "bb4");
    EXPECT_EQ(g.back(), "ab0");
  }
}

TEST(GlaModelInterface, UnitRangesGiveTheBitsOfOneForwardBackward) {
  const int64_t B = 2, T = 24;
  const auto tok = test::random_tokens(B * T + 1, 101, 4);
  for (bool conv : {false, true}) {
    const GlaConfig c = small(conv, !conv);
    GlaModel whole(c, DType::f32), split(c, DType::f32);
    whole.init_weights(2);
    split.init_weights(2);
    const double loss = whole.forward_backward(tok.data(), tok.data() + 1, B, T, 0.5f);
    // Two "stages": units [0, 2) and [2, 5), as a pipeline would run them.
    ActivationStore s = split.micro_batch(tok.data(), tok.data() + 1, B, T, 0.5f);
    Tensor x = split.forward(s, 0, 2);
    EXPECT_FALSE(split.forward(s, 2, split.num_units(), x).defined());
    Tensor dx = split.backward(s, 2, split.num_units());
    ASSERT_TRUE(dx.defined());
    EXPECT_FALSE(split.backward(s, 0, 2, dx).defined());
    EXPECT_EQ(split.loss(s), loss);
    EXPECT_EQ(grads(split), grads(whole));
  }
}

TEST(GlaModelInterface, ShardedWithoutHooksIsRefused) {
  GlaModel m(small(false, false), DType::f32, Device::cpu, ShardLayout{0, 2});
  const auto tok = test::random_tokens(33, 101, 5);
  test::expect_error([&] { m.forward_backward(tok.data(), tok.data() + 1, 2, 16, 1.0f); },
                     {"needs hooks"});
}

TEST(GlaModelInterface, ConfigJsonChoosesTheModel) {
  const GlaConfig g = small(true, false);
  const std::unique_ptr<Model> a =
      make_model(ModelConfig::from_json(g.to_json(), "gla.json"), DType::f32, Device::meta);
  EXPECT_STREQ(a->model_type(), "gla");
  EXPECT_EQ(a->num_params(), g.num_params());
  const LlamaConfig l = small_llama(true);
  const std::unique_ptr<Model> b =
      make_model(ModelConfig::from_json(l.to_json(), "llama.json"), DType::f32, Device::meta);
  EXPECT_STREQ(b->model_type(), "llama");
  EXPECT_EQ(b->num_params(), l.num_params());
  test::expect_error([&] { ModelConfig(l).gla("the test"); }, {"needs a GLA model"});
}

// The cost oracle's figure of one block's saved tensors (tests/support/gla_cost.cpp) is what a
// step saves, field by field: every mode, with and without the short convolution, f32 and bf16.
TEST(GlaModelInterface, AnalyticSavedActivationsMatchAStep) {
  const int64_t B = 2, T = 20;
  const auto tok = test::random_tokens(B * T + 1, 101, 6);
  using Mode = ActivationCheckpoint::Mode;
  for (bool conv : {false, true})
    for (DType dt : {DType::f32, DType::bf16})
      for (Mode mode : {Mode::none, Mode::op, Mode::full}) {
        SCOPED_TRACE(std::string(conv ? "conv " : "") + std::string(dtype_name(dt)) + " mode " +
                     std::to_string(int(mode)));
        GlaModel m(small(conv, false), dt);
        m.init_weights(1);
        m.set_activation_checkpoint({mode, 1});
        m.forward_backward(tok.data(), tok.data() + 1, B, T, 1.0f);
        const size_t block = oracle::gla_block_saved_bytes(m, B, T, mode);
        EXPECT_EQ(m.last_saved_activation_bytes(), 3 * block);
        if (mode == Mode::full) {
          // The recomputed last block holds everything while the two before it hold their input.
          EXPECT_EQ(oracle::saved_activation_bytes(m, B, T),
                    2 * block + oracle::gla_block_saved_bytes(m, B, T, Mode::none));
        } else {
          EXPECT_EQ(oracle::saved_activation_bytes(m, B, T), 3 * block);
        }
      }
}

// A pipeline rank builds the units it does not use on the meta device: no CPU memory for their
// weights, gradients or mirrors, while the units it uses get the bits of the whole model's
// initialization (a pure function of seed, name and index), for Llama and GLA, f32 and bf16.
TEST(GlaModelInterface, UnusedUnitsHoldNoMemory) {
  for (bool gla : {false, true})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(gla ? "gla " : "llama ") + std::string(dtype_name(dt)));
      const ModelConfig mc = gla ? ModelConfig::from_json(small(false, false).to_json(), "g.json")
                                 : ModelConfig::from_json(small_llama(false).to_json(), "l.json");
      const std::unique_ptr<Model> whole = make_model(mc, dt);
      whole->init_weights(7);
      const size_t n = whole->num_units();
      std::vector<bool> used(n, false);
      used[1] = used[n - 1] = true;  // block 0 and the head
      auto& alloc = Allocator::get(Device::cpu);
      const size_t before = alloc.stats().allocated;
      const std::unique_ptr<Model> part =
          make_model(mc, dt, Device::cpu, {}, {}, {}, std::vector<bool>(used));
      const size_t held = alloc.stats().allocated - before;
      part->init_weights(7);
      part->zero_grad();
      size_t expected = 0;
      auto pu = part->units(), wu = whole->units();
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(pu[i]->device(), used[i] ? Device::cpu : Device::elsewhere) << pu[i]->name();
        if (!used[i]) continue;
        expected += size_t(pu[i]->numel()) * (8 + (dt == DType::bf16 ? 2 : 0));
        const Tensor a = pu[i]->master_shard(), b = wu[i]->master_shard();
        ASSERT_EQ(a.numel(), b.numel());
        EXPECT_TRUE(std::equal(a.data<float>(), a.data<float>() + a.numel(), b.data<float>()))
            << pu[i]->name();
      }
      // The used units' f32 weights and gradients (and bf16 mirrors), plus what the allocator
      // adds (512-byte rounding, a larger cached block reused; Llama's rope tables): well under
      // one unused block. The whole model holds more than twice that here.
      EXPECT_GE(held, expected);
      EXPECT_LT(held, expected + (64 << 10));
      const size_t whole_bytes = size_t(whole->num_params()) * (8 + (dt == DType::bf16 ? 2 : 0));
      EXPECT_LT(2 * held, whole_bytes);
    }
}
