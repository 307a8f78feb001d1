// LlamaModel's per-micro-batch forward/backward over unit ranges (what a pipeline stage runs):
// split at any unit, the pieces give forward_backward's bits and its hook calls in its order; the
// activation store lives between the calls, so micro-batches can interleave; the meta device
// runs a whole step computing nothing while booking memory; and gradients that zero_grad leaves
// unwritten (ParamUnit::zero_grad) come out of two micro-batches as from zeros.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/philox.hpp"
#include "model/llama.hpp"
#include "ops/ops.hpp"
#include "tests/support/model_cost.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

LlamaConfig config(bool tied = false) {
  LlamaConfig c;
  c.tie_word_embeddings = tied;
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
    EXPECT_EQ(split.loss(s), loss);
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
  EXPECT_EQ(pipe.loss(a), l0);
  EXPECT_EQ(pipe.loss(b), l1);
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
  // Everything of the step freed but the loss slots' first chunk, which the model keeps.
  EXPECT_EQ(meta.stats().allocated,
            before + Allocator::round_size(LossSlots::kChunk * sizeof(double)));
  EXPECT_EQ(plan.forward_backward(in.data(), tg.data(), B, T, 1.0f), 0.0);
  EXPECT_EQ(meta.stats().allocated,
            before + Allocator::round_size(LossSlots::kChunk * sizeof(double)));
  EXPECT_GE(meta.stats().peak_allocated - before,
            oracle::llama_activations(config(), B, T, DType::bf16).peak);
}

TEST(MicroBatch, UnitRangeOutsideTheModelIsAnError) {
  LlamaModel m(config(), DType::f32);
  const auto in = tokens(16, 1);
  ActivationStore s = m.micro_batch(in.data(), in.data(), 1, 16, 1.0f);
  test::expect_error([&] { m.forward(s, 2, m.num_units() + 1); }, {"forward", "units"});
  test::expect_error([&] { m.backward(s, 3, 2); }, {"backward", "units"});
}

// zero_grad leaves the gradients that only dW GEMMs write (the block projections, an untied
// output head) as they are, marked unwritten; the first GEMM of the step writes them. Filled with
// NaN before zero_grad, the gradients after two micro-batches are those of a model whose
// gradients started at zero, and one never written is an error naming it, not a stale value.
TEST(MicroBatch, UnwrittenGradientsAreOverwrittenNotRead) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t B = 2, T = 16;
  const auto two_micro_batches = [&](LlamaModel& m) {
    for (uint64_t s : {1, 2}) {
      const auto in = tokens(B * T, 10 * s), tg = tokens(B * T, 10 * s + 1);
      m.forward_backward(in.data(), tg.data(), B, T, 0.25f);
    }
  };
  for (DType dt : {DType::f32, DType::bf16})
    for (bool tied : {false, true}) {
      const std::string what = std::string(dtype_name(dt)) + (tied ? " tied" : " untied");
      LlamaModel fresh(config(tied), dt), stale(config(tied), dt);
      fresh.init_weights(3);
      stale.init_weights(3);
      two_micro_batches(fresh);  // gradients start at zero (construction)

      for (ParamUnit* u : stale.units()) ops::fill(u->grad_flat(), nan);
      stale.zero_grad();
      // The pass skipped exactly the gemm_grad parameters: they still hold the NaNs.
      size_t skipped = 0;
      for (ParamUnit* u : stale.units())
        for (const Param& p : u->params()) {
          const float* g = p.grad.data<float>();
          for (int64_t i = 0; i < p.grad.numel(); ++i)
            ASSERT_EQ(std::isnan(g[i]), p.spec.gemm_grad) << what << " " << p.spec.name;
          skipped += p.spec.gemm_grad;
        }
      EXPECT_EQ(skipped, 3 * 7 + (tied ? 0 : 1)) << what;
      try {
        stale.check_grads_written();
        ADD_FAILURE() << what << ": expected an error";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find("never written after zero_grad"), std::string::npos) << msg;
      }
      two_micro_batches(stale);
      EXPECT_NO_THROW(stale.check_grads_written()) << what;
      // Written is what adding to zeros gives (the GEMM's sum is the same; 0 + s = s).
      EXPECT_EQ(grads(stale), grads(fresh)) << what;
      // A fused gradient is all gemm_grad parameters or none: q, k, v, o and the norm after them
      // are not one.
      EXPECT_THROW(stale.units()[1]->weight_grad(1, 5), Error) << what;
    }
}

// An FSDP unit's full gradient, materialized for a backward, is marked as zero_grad marks an
// unsharded one: zeros but for the gemm_grad parameters (and the padding zeroed), which the first
// GEMM writes; reduce-scattering it before that is an error (Fsdp::reduce checks).
TEST(MicroBatch, MaterializedFullGradientsAreMarkedUnwritten) {
  std::vector<ParamSpec> specs(2);
  specs[0] = {"norm.weight", {5}, Init::ones, 0, false, true};
  specs[1] = {"proj.weight", {3, 4}, Init::normal, 0.02f, true, false};
  specs[1].gemm_grad = true;
  ParamUnit u("u", specs, false, Device::cpu, ShardLayout{0, 2});
  ASSERT_EQ(u.padded_numel(), 18);
  u.materialize_grads();
  EXPECT_THROW(u.check_grads_written(), Error);
  const float* g = u.grad_flat().data<float>();
  for (int64_t i : {0, 4, 17}) EXPECT_EQ(g[i], 0.0f) << i;  // the norm and the padding
  Tensor x = Tensor::empty({2, 4}, DType::f32), dy = Tensor::empty({2, 3}, DType::f32),
         w = Tensor::empty({3, 4}, DType::f32), dx = Tensor::empty({2, 4}, DType::f32);
  ops::fill(x, 1.0f);
  ops::fill(dy, 0.5f);
  ops::fill(w, 1.0f);
  ops::linear_backward(dy, x, w, u.weight_grad(1), dx);
  EXPECT_NO_THROW(u.check_grads_written());
  for (int64_t i = 5; i < 17; ++i) EXPECT_EQ(g[i], 1.0f) << i;  // 2 rows of 0.5 * 1
}
