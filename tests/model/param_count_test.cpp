// Exact parameter counts of the shipped model configs, each built on Device::meta (names and
// shapes, no memory), against the published count and against a closed form written here from
// the config's dims. The published figure catches a wrong config (a dim mistyped in configs/),
// the closed form a model that builds a tensor of the wrong shape or one too many or too few;
// the planner (`loom plan`) sizes every shard from these models, so an error here is an error in
// every figure it prints.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "model/model_config.hpp"

using namespace loom;
namespace fs = std::filesystem;

namespace {

std::string config_path(const std::string& name) {
  // ctest sets LOOM_SOURCE_DIR; run by hand, the binary finds the tree from this file's path.
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  const std::string root =
      s && *s ? s : fs::path(__FILE__).parent_path().parent_path().parent_path().string();
  return (fs::path(root) / "configs" / (name + ".json")).string();
}

// Llama (Hugging Face LlamaForCausalLM, no biases): per layer q, k, v, o, the SwiGLU MLP's gate,
// up and down, and the two RMSNorms; then the embedding, the head unless tied, the final norm.
int64_t llama_closed_form(const LlamaConfig& c) {
  const int64_t d = c.hidden_size, F = c.intermediate_size, hd = c.head_dim();
  const int64_t q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  const int64_t attention = d * q + 2 * d * kv + q * d;
  const int64_t mlp = 3 * d * F;
  const int64_t layer = attention + mlp + 2 * d;
  const int64_t embed = c.vocab_size * d, head = c.tie_word_embeddings ? 0 : c.vocab_size * d;
  return c.num_hidden_layers * layer + embed + head + d;
}

// GLA as fla defines it (../shared/specs/GLA.md section 2), with G = H / H_kv, Kd = d *
// expand_k, Vd = d * expand_v, V = Vd / H, r = 16: per layer attn_norm [d], q [Kd, d],
// k [Kd/G, d], v [Vd/G, d], g [Vd, d] (output gate), gk_proj.0 [r, d], gk_proj.1 [Kd/G, r] and
// its bias [Kd/G] (the model's only bias), the output norm [V] shared by the heads, o [d, Vd],
// the short convolutions [., 1, W] when on, mlp_norm [d], gate and up [F, d], down [d, F]; then
// the embedding, the head unless tied, the final norm.
int64_t gla_closed_form(const GlaConfig& c) {
  const int64_t d = c.hidden_size, F = c.intermediate_size, r = c.gate_low_rank_dim;
  const int64_t G = c.kv_groups(), Kd = c.key_dim(), Vd = c.value_dim(), V = c.head_v_dim();
  int64_t attention = Kd * d + (Kd / G) * d + (Vd / G) * d + d * Vd;
  if (c.use_output_gate) attention += Vd * d;
  attention += r * d + (Kd / G) * r + Kd / G;
  if (c.elementwise_affine) attention += V;
  if (c.use_short_conv) attention += c.conv_size * (Kd + Kd / G + Vd / G);
  const int64_t mlp = 3 * d * F;
  const int64_t layer = attention + mlp + 2 * d;
  const int64_t embed = c.vocab_size * d, head = c.tie_word_embeddings ? 0 : c.vocab_size * d;
  return c.num_hidden_layers * layer + embed + head + d;
}

struct Built {
  int64_t params;
  double seconds;
};

// The model of configs/<name>.json on meta, timed: meta tensors hold no data, so building even
// 405B must be quick; a slow build means something touches every element.
Built build_on_meta(const ModelConfig& mc) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto model = make_model(mc, DType::f32, Device::meta);
  const int64_t n = model->num_params();
  const auto t1 = std::chrono::steady_clock::now();
  return {n, std::chrono::duration<double>(t1 - t0).count()};
}

void expect_llama(const std::string& name, int64_t published) {
  SCOPED_TRACE(name);
  const ModelConfig mc = ModelConfig::from_file(config_path(name));
  ASSERT_FALSE(mc.is_gla());
  const int64_t closed = llama_closed_form(mc.llama("param_count_test"));
  EXPECT_EQ(closed, published);
  const Built b = build_on_meta(mc);
  EXPECT_EQ(b.params, published);
  EXPECT_EQ(b.params, closed);
  EXPECT_EQ(mc.num_params(), published);  // the config's own count (the planner's headline)
  EXPECT_LT(b.seconds, 0.5);
}

void expect_gla(const std::string& name, int64_t published) {
  SCOPED_TRACE(name);
  const ModelConfig mc = ModelConfig::from_file(config_path(name));
  ASSERT_TRUE(mc.is_gla());
  const int64_t closed = gla_closed_form(mc.gla("param_count_test"));
  EXPECT_EQ(closed, published);
  const Built b = build_on_meta(mc);
  EXPECT_EQ(b.params, published);
  EXPECT_EQ(b.params, closed);
  EXPECT_EQ(mc.num_params(), published);
  EXPECT_LT(b.seconds, 0.5);
}

}  // namespace

// Meta's published counts (the Llama 3 model cards' safetensors totals): untied, GQA with 8 kv
// heads of 128.
TEST(ParamCount, Llama3_8B) {
  expect_llama("llama3-8b", 8'030'261'248);
}
TEST(ParamCount, Llama3_70B) {
  expect_llama("llama3-70b", 70'553'706'496);
}
TEST(ParamCount, Llama3_405B) {
  expect_llama("llama3-405b", 405'853'388'800);
}

// configs/gla-340m.json is flame's gla_340M (tie_word_embeddings false): GLA.md's preset table
// gives 374,475,776 (fla's legacy tied config would be 341,707,776, one [32000, 1024] matrix
// less).
TEST(ParamCount, Gla340M) {
  expect_gla("gla-340m", 374'475'776);
}

// configs/gla-1.3b.json is fla's default GLAConfig (fla-hub/gla-1.3B-100B; GLA.md's "gla_1B"
// row). From fla's shapes with d = 2048, Kd = 1024, Vd = 2048, V = 512, F = 5632 (= 256 *
// ceil(int(2048 * 4 * 2/3) / 256)), H = H_kv = 4, r = 16:
//   per layer: q 1024*2048 + k 1024*2048 + v 2048*2048 + g 2048*2048 + o 2048*2048 = 16,777,216
//              gk_proj 16*2048 + 1024*16 + 1024 = 50,176; output norm 512; two norms 4,096
//              MLP 3*2048*5632 = 34,603,008                        -> 51,435,008
//   24 layers 1,234,440,192 + embedding and head 2*32000*2048 = 131,072,000 + final norm 2,048
//   = 1,365,514,240 (HF lists bailin28/gla-1B-100B, the same shapes, as 1.37B).
TEST(ParamCount, Gla1_3B) {
  expect_gla("gla-1.3b", 1'365'514'240);
}
