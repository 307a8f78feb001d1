// Generation on the GPU against the CPU (skipped without a GPU; LOOM_REQUIRE_GPU=1 fails
// instead): a tiny Llama (GQA, an odd vocabulary and head dim 24, Llama 3.1's RoPE scaling, tied
// and untied), a tiny GLA (with and without the short convolution) and the three mixtures of
// experts' debug shapes (tests/parity/moe_*.json: the router, the grouping, the experts' GEMMs and
// the weighted sum on the GPU; Qwen2-MoE's biases and shared expert gate), the same weights on both
// devices, the prompt's logits (prefill: the flash attention over the prompt, GLA's chunked core)
// and then one token at a time (the decode attention against the KV cache, GLA's recurrent state):
// every position's logits within 1e-5 relative L2 of the CPU's, f32 with TF32 off.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/read_file.hpp"
#include "kernels/cuda/gemm.hpp"
#include "model/gla.hpp"
#include "model/gla_inference.hpp"
#include "model/llama.hpp"
#include "model/llama_inference.hpp"
#include "model/moe.hpp"
#include "model/moe_inference.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/model/kv_cache_checks.hpp"
#include "tests/model/tiny_gla.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

constexpr double kTol = 1e-5;

class InferenceCuda : public test::CudaTest {
 protected:
  void SetUp() override {
    test::CudaTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    prev_tf32_ = cuda::allow_tf32();
    cuda::set_allow_tf32(false);
  }
  void TearDown() override { cuda::set_allow_tf32(prev_tf32_); }

 private:
  bool prev_tf32_ = false;
};

// The CPU model's weights into the GPU model's units (the same layout on both).
void copy_weights(Model& from, Model& to) {
  const std::vector<ParamUnit*> a = from.units(), b = to.units();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) b[i]->flat().copy_from(a[i]->flat());
}

// Feeds the same tokens to both: the prompt with every position's logits, then `steps` tokens one
// at a time (the CPU's greedy choice, so both follow one sequence).
template <class Inference>
void expect_same_generation(Inference& cpu, Inference& gpu, int64_t V, int64_t prompt, int steps) {
  std::vector<int32_t> tok = test::random_tokens(prompt, V, 7);
  Tensor a = cpu.forward(tok.data(), prompt, true), b = gpu.forward(tok.data(), prompt, true);
  ASSERT_EQ(b.device(), Device::cuda);
  const std::vector<float> pa(a.data<float>(), a.data<float>() + a.numel());
  EXPECT_LE(test::rel_l2(test::to_host(b), pa), kTol) << "prompt of " << prompt;
  int32_t next = 0;
  for (int64_t v = 1; v < V; ++v)
    if (pa[size_t((prompt - 1) * V + v)] > pa[size_t((prompt - 1) * V + next)]) next = int32_t(v);
  for (int s = 0; s < steps; ++s) {
    a = cpu.forward(&next, 1);
    b = gpu.forward(&next, 1);
    const std::vector<float> la(a.data<float>(), a.data<float>() + V);
    EXPECT_LE(test::rel_l2(test::to_host(b), la), kTol) << "step " << s;
    next = 0;
    for (int64_t v = 1; v < V; ++v)
      if (la[size_t(v)] > la[size_t(next)]) next = int32_t(v);
  }
}

LlamaConfig llama_config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 96;
  c.intermediate_size = 160;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 211;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.tie_word_embeddings = tied;
  c.rope_scaling.llama3 = true;
  c.rope_scaling.factor = 8;
  c.rope_scaling.low_freq_factor = 1;
  c.rope_scaling.high_freq_factor = 4;
  c.rope_scaling.original_max_position = 16;
  return c;
}

TEST_F(InferenceCuda, LlamaMatchesCpu) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig c = llama_config(tied);
    LlamaModel cpu(c, DType::f32), gpu(c, DType::f32, Device::cuda);
    cpu.init_weights(3);
    copy_weights(cpu, gpu);
    LlamaInference a(cpu, 40), b(gpu, 40);
    expect_same_generation(a, b, c.vocab_size, 13, 12);
  }
}

TEST_F(InferenceCuda, GlaMatchesCpu) {
  for (const bool conv : {false, true}) {
    SCOPED_TRACE(conv ? "short conv" : "no conv");
    const GlaConfig c = test::tiny_gla_config(97, conv, !conv);
    GlaModel cpu(c, DType::f32), gpu(c, DType::f32, Device::cuda);
    cpu.init_weights(3);
    copy_weights(cpu, gpu);
    GlaInference a(cpu), b(gpu);
    expect_same_generation(a, b, c.vocab_size, 70, 12);  // a prompt of more than one chunk
  }
}

// Unit-scale weights (the router's logits well apart: the two devices' GEMMs, a few ulps apart,
// choose the same experts), the CPU model's copied to the GPU's.
TEST_F(InferenceCuda, MixturesOfExpertsMatchCpu) {
  const char* src = std::getenv("LOOM_SOURCE_DIR");
  for (const char* file : {"moe_debug.json", "moe_qwen2_debug.json", "moe_mixtral_debug.json"}) {
    SCOPED_TRACE(file);
    const std::string path = std::string(src ? src : ".") + "/tests/parity/" + file;
    const MoeConfig c = MoeConfig::from_json(read_file(path), path);
    MoeModel cpu(c, DType::f32), gpu(c, DType::f32, Device::cuda);
    test::randomize_unit_scale(cpu, 5);
    copy_weights(cpu, gpu);
    MoeInference a(cpu, 40), b(gpu, 40);
    expect_same_generation(a, b, c.base.vocab_size, 13, 12);
  }
}

}  // namespace
