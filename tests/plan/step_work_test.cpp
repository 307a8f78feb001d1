// The work a whole training step reports on the meta device (what the planner times): its GEMM
// flops are 6 x tokens x the matmul parameters (forward, then dx and dw), and its attention the
// tiles of every layer.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "kernels/cpu/attention_block.hpp"
#include "model/llama.hpp"
#include "ops/ops.hpp"
#include "tests/test_util.hpp"

using namespace loom;

TEST(StepWork, LlamaStepIsSixFlopsPerParameterAndToken) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 136;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 301;
  c.max_position_embeddings = 256;
  const int64_t B = 2, T = 96, D = 64, hd = 16, F = 136, V = 301, L = 3;
  const auto in = test::random_tokens(B * T, V, 1), tg = test::random_tokens(B * T, V, 2);
  LlamaModel m(c, DType::bf16, Device::meta);
  m.init_weights(1);
  double gemm = 0;
  std::map<std::string, double> flops;
  {
    ops::RecordWork record([&](const ops::KernelWork& w) {
      if (w.m > 0) {
        gemm += w.flops;
        EXPECT_EQ(w.dtype, DType::bf16) << w.op;
      }
      flops[w.op] += w.flops;
    });
    m.forward_backward(in.data(), tg.data(), B, T, 1.0f);
  }
  const double per_layer = D * (D + 2 * 2 * hd) + D * D + 3 * D * F;
  EXPECT_EQ(gemm, 6.0 * double(B * T) * (L * per_layer + V * D));
  std::vector<int64_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = t;
  const double entries = double(cpu::tiled_entries(pos.data(), T, pos.data(), T));
  EXPECT_EQ(flops["attention_forward"], L * 4.0 * B * 4 * hd * entries);
  EXPECT_EQ(flops["attention_backward"], 2.5 * flops["attention_forward"]);
  for (const char* op :
       {"rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "rope_forward",
        "rope_backward", "embedding_forward", "embedding_backward", "linear_cross_entropy"})
    EXPECT_TRUE(flops.count(op)) << op << " not reported";
}
