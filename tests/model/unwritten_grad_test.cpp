// ParamUnit::zero_grad leaves the gradients that only dW GEMMs write (the block projections, an
// untied output head) as they are, marked unwritten; the first GEMM of the step writes them. Filled
// with NaN before zero_grad, a model's gradients after two micro-batches are those of a model whose
// gradients started at zero, and a gradient never written is an error, not a silent stale value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/llama.hpp"
#include "ops/ops.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

LlamaConfig config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 136;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 301;
  c.max_position_embeddings = 256;
  c.tie_word_embeddings = tied;
  return c;
}

std::vector<float> grads(LlamaModel& m) {
  std::vector<float> g;
  for (ParamUnit* u : m.units()) {
    const Tensor& t = u->grad_flat();
    g.insert(g.end(), t.data<float>(), t.data<float>() + t.numel());
  }
  return g;
}

// Two micro-batches of forward and backward, gradients accumulating.
void two_micro_batches(LlamaModel& m) {
  const int64_t B = 2, T = 16;
  for (uint64_t s : {1, 2}) {
    const auto in = test::random_tokens(B * T, 301, 10 * s),
               tg = test::random_tokens(B * T, 301, 10 * s + 1);
    m.forward_backward(in.data(), tg.data(), B, T, 0.25f);
  }
}

}  // namespace

TEST(UnwrittenGrad, StaleGradientsAreOverwrittenNotRead) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
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
      EXPECT_EQ(skipped, 2 * 7 + (tied ? 0 : 1)) << what;
      EXPECT_THROW(stale.check_grads_written(), Error) << what;
      two_micro_batches(stale);
      EXPECT_NO_THROW(stale.check_grads_written()) << what;
      // Written is what adding to zeros gives (the GEMM's sum is the same; 0 + s = s).
      EXPECT_EQ(grads(stale), grads(fresh)) << what;
    }
}

TEST(UnwrittenGrad, AGradientNeverWrittenNamesItsParameter) {
  LlamaModel m(config(false), DType::f32);
  m.init_weights(3);
  m.zero_grad();
  try {
    m.check_grads_written();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("never written after zero_grad"), std::string::npos) << msg;
  }
  // A fused gradient is all gemm_grad parameters or none: q, k, v, o and the norm after them
  // are not one.
  EXPECT_THROW(m.units()[1]->weight_grad(1, 5), Error);
}
