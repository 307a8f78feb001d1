// LlamaModel's per-micro-batch forward/backward over unit ranges (what a pipeline stage runs):
// split at any unit, the pieces give forward_backward's bits and its hook calls in its order; the
// activation store lives between the calls, so micro-batches can interleave; and the meta device
// runs a whole step computing nothing while booking memory.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/philox.hpp"
#include "model/llama.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

LlamaConfig config() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 136;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 301;
  c.max_position_embeddings = 256;
  return c;
}

std::vector<int32_t> tokens(int64_t n, uint64_t seed) {
  return test::random_tokens(n, 301, seed);
}

struct Recorder : UnitHooks {
  std::vector<std::string> calls;
  void before_forward(size_t u) override { calls.push_back("bf" + std::to_string(u)); }
  void after_forward(size_t u) override { calls.push_back("af" + std::to_string(u)); }
  void before_backward(size_t u) override { calls.push_back("bb" + std::to_string(u)); }
  void after_backward(size_t u) override { calls.push_back("ab" + std::to_string(u)); }
};

std::vector<float> grads(LlamaModel& m) {
  std::vector<float> g;
  for (ParamUnit* u : m.units()) {
    const Tensor& t = u->grad_flat();
    g.insert(g.end(), t.data<float>(), t.data<float>() + t.numel());
  }
  return g;
}

}  // namespace

TEST(MicroBatch, SplitRangesGiveTheWholeModelsBitsAndHooks) {
  const int64_t B = 2, T = 16;
  const auto in = tokens(B * T, 1), tg = tokens(B * T, 2);
  for (DType dt : {DType::f32, DType::bf16}) {
    LlamaModel whole(config(), dt), split(config(), dt);
    whole.init_weights(3);
    split.init_weights(3);
    Recorder hw, hs;
    whole.set_hooks(&hw);
    split.set_hooks(&hs);
    const double loss = whole.forward_backward(in.data(), tg.data(), B, T, 0.5f);
    const size_t n = split.num_units(), cut = 2;  // stage 0: embedding + block 0
    ActivationStore s = split.micro_batch(in.data(), tg.data(), B, T, 0.5f);
    Tensor x = split.forward(s, 0, cut);
    EXPECT_FALSE(split.forward(s, cut, n, x).defined());
    Tensor dx = split.backward(s, cut, n);
    EXPECT_FALSE(split.backward(s, 0, cut, dx).defined());
    EXPECT_EQ(s.loss, loss);
    EXPECT_EQ(grads(split), grads(whole));
    EXPECT_EQ(hs.calls, hw.calls);
  }
}

TEST(MicroBatch, InterleavedMicroBatchesKeepTheirOwnActivations) {
  const int64_t B = 1, T = 16;
  const auto in0 = tokens(T, 4), tg0 = tokens(T, 5), in1 = tokens(T, 6), tg1 = tokens(T, 7);
  LlamaModel seq(config(), DType::f32), pipe(config(), DType::f32);
  seq.init_weights(3);
  pipe.init_weights(3);
  const double l0 = seq.forward_backward(in0.data(), tg0.data(), B, T, 1.0f);
  const double l1 = seq.forward_backward(in1.data(), tg1.data(), B, T, 1.0f);
  const size_t n = pipe.num_units();
  ActivationStore a = pipe.micro_batch(in0.data(), tg0.data(), B, T, 1.0f);
  ActivationStore b = pipe.micro_batch(in1.data(), tg1.data(), B, T, 1.0f);
  pipe.forward(a, 0, n);
  pipe.forward(b, 0, n);
  pipe.backward(b, 0, n);
  pipe.backward(a, 0, n);
  EXPECT_EQ(a.loss, l0);
  EXPECT_EQ(b.loss, l1);
  // The gradients add up in another order: equal to rounding.
  const auto gs = grads(seq), gp = grads(pipe);
  EXPECT_LT(test::rel_l2(gp, gs), 1e-6);
}

TEST(MicroBatch, MetaDeviceRunsAStepAndBooksItsMemory) {
  auto& meta = Allocator::get(Device::meta);
  const int64_t B = 2, T = 32;
  const auto in = tokens(B * T, 8), tg = tokens(B * T, 9);
  LlamaModel plan(config(), DType::bf16, Device::meta);
  plan.init_weights(1);
  meta.reset_peak();
  const size_t before = meta.stats().allocated;
  EXPECT_EQ(plan.forward_backward(in.data(), tg.data(), B, T, 1.0f), 0.0);
  EXPECT_EQ(meta.stats().allocated, before);  // everything of the step freed
  EXPECT_GE(meta.stats().peak_allocated - before,
            LlamaModel::saved_activation_bytes(config(), B, T, DType::bf16));
}

TEST(MicroBatch, UnitRangeOutsideTheModelIsAnError) {
  LlamaModel m(config(), DType::f32);
  const auto in = tokens(16, 1);
  ActivationStore s = m.micro_batch(in.data(), in.data(), 1, 16, 1.0f);
  test::expect_error([&] { m.forward(s, 2, m.num_units() + 1); }, {"forward", "units"});
  test::expect_error([&] { m.backward(s, 3, 2); }, {"backward", "units"});
}
