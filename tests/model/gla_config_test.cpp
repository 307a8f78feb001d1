#include "model/gla_config.hpp"

#include "model/llama_config.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using loom::GlaConfig;
using json = nlohmann::json;
using loom::test::expect_error;

namespace {

std::string config_path(const std::string& name) {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  const std::string root =
      s && *s ? s : fs::path(__FILE__).parent_path().parent_path().parent_path().string();
  return (fs::path(root) / "configs" / (name + ".json")).string();
}

void expect_bad(const json& j, const std::vector<std::string>& parts) {
  std::vector<std::string> all = parts;
  all.push_back("cfg.json");
  expect_error([&] { GlaConfig::from_json(j.dump(), "cfg.json"); }, all);
}

}  // namespace

// The presets against the counts of ../shared/specs/GLA.md (flame's gla_340M and fla's default
// GLAConfig, computed there from fla's parameter shapes), and the tied 340M of fla's legacy config.
TEST(GlaConfig, PresetParameterCounts) {
  const GlaConfig small = GlaConfig::from_file(config_path("gla-340m"));
  EXPECT_EQ(small.intermediate_size, 2816);  // 256 * ceil(int(1024 * 4 * 2/3) / 256)
  EXPECT_EQ(small.head_k_dim(), 128);
  EXPECT_EQ(small.head_v_dim(), 256);
  EXPECT_EQ(small.num_params(), 374475776);
  GlaConfig tied = small;
  tied.tie_word_embeddings = true;
  EXPECT_EQ(tied.num_params(), 341707776);
  const GlaConfig big = GlaConfig::from_file(config_path("gla-1.3b"));
  EXPECT_EQ(big.intermediate_size, 5632);
  EXPECT_EQ(big.num_params(), 1365514240);
  // fla's defaults: a config with nothing but the model type is the 1.3B.
  EXPECT_EQ(GlaConfig::from_json(R"({"model_type": "gla"})", "cfg.json").num_params(),
            big.num_params());
}

// fla's names and shapes, GQA (k, v, gk_proj.1 shrink by G), the optional pieces.
TEST(GlaConfig, ParameterNamesAndShapes) {
  GlaConfig c = GlaConfig::from_json(json{{"hidden_size", 64},
                                          {"num_heads", 4},
                                          {"num_kv_heads", 2},
                                          {"num_hidden_layers", 1},
                                          {"vocab_size", 100},
                                          {"use_short_conv", true},
                                          {"conv_size", 3},
                                          {"intermediate_size", 96}}
                                         .dump(),
                                     "cfg.json");
  std::map<std::string, std::vector<int64_t>> want = {
      {"model.embeddings.weight", {100, 64}},
      {"model.layers.0.attn_norm.weight", {64}},
      {"model.layers.0.attn.q_proj.weight", {32, 64}},
      {"model.layers.0.attn.k_proj.weight", {16, 64}},
      {"model.layers.0.attn.v_proj.weight", {32, 64}},
      {"model.layers.0.attn.g_proj.weight", {64, 64}},
      {"model.layers.0.attn.gk_proj.0.weight", {16, 64}},
      {"model.layers.0.attn.gk_proj.1.weight", {16, 16}},
      {"model.layers.0.attn.gk_proj.1.bias", {16}},
      {"model.layers.0.attn.g_norm_swish_gate.weight", {16}},
      {"model.layers.0.attn.o_proj.weight", {64, 64}},
      {"model.layers.0.attn.q_conv1d.weight", {32, 1, 3}},
      {"model.layers.0.attn.k_conv1d.weight", {16, 1, 3}},
      {"model.layers.0.attn.v_conv1d.weight", {32, 1, 3}},
      {"model.layers.0.mlp_norm.weight", {64}},
      {"model.layers.0.mlp.gate_proj.weight", {96, 64}},
      {"model.layers.0.mlp.up_proj.weight", {96, 64}},
      {"model.layers.0.mlp.down_proj.weight", {64, 96}},
      {"model.norm.weight", {64}},
      {"lm_head.weight", {100, 64}}};
  const auto params = c.params();
  EXPECT_EQ(params.size(), want.size());
  for (const auto& p : params) {
    ASSERT_TRUE(want.count(p.name)) << p.name;
    EXPECT_EQ(p.shape, want[p.name]) << p.name;
  }
  // Without the output gate the norm is plain g_norm and g_proj is gone.
  c.use_output_gate = false;
  bool has_g = false, has_norm = false;
  for (const auto& p : c.params()) {
    has_g |= p.name.find("g_proj") != std::string::npos;
    has_norm |= p.name == "model.layers.0.attn.g_norm.weight";
  }
  EXPECT_FALSE(has_g);
  EXPECT_TRUE(has_norm);
}

TEST(GlaConfig, JsonRoundTrip) {
  GlaConfig c = GlaConfig::from_file(config_path("gla-340m"));
  c.has_clamp_min = true;
  c.clamp_min = -5;
  c.num_kv_heads = 2;
  const GlaConfig d = GlaConfig::from_json(c.to_json(), "roundtrip");
  EXPECT_EQ(d.to_json(), c.to_json());
  EXPECT_EQ(d.num_params(), c.num_params());
  EXPECT_EQ(d.clamp_min, -5);
}

// fla options loom does not implement are refused by name, and bad values name the field.
TEST(GlaConfig, RefusesWhatLoomDoesNotImplement) {
  const json base{{"model_type", "gla"}, {"hidden_size", 64}, {"num_heads", 4}};
  auto with = [&](const char* k, json v) {
    json j = base;
    j[k] = v;
    return j;
  };
  expect_bad(with("attn", json{{"layers", {1}}, {"num_heads", 4}}), {"'attn'", "hybrid"});
  expect_bad(with("feature_map", "relu"), {"'feature_map'", "relu"});
  expect_bad(with("use_l2warp", true), {"'use_l2warp'"});
  expect_bad(with("attnres_block_size", 4), {"'attnres_block_size'"});
  expect_bad(with("hidden_act", "powlu"), {"'hidden_act'", "powlu", "swish"});
  expect_bad(with("attn_mode", "parallel"), {"'attn_mode'", "parallel"});
  expect_bad(with("model_type", "llama"), {"'model_type'", "gla", "llama"});
  expect_bad(with("num_kv_heads", 3), {"'num_kv_heads'", "3"});
  expect_bad(with("expand_k", 0.3), {"expand_k", "19"});
  expect_bad(with("hidden_size", "64"), {"'hidden_size'", "integer"});
  expect_bad(with("clamp_min", 0.5), {"'clamp_min'"});
  expect_bad(with("use_short_conv", 1), {"'use_short_conv'", "true or false"});
  expect_error([] { GlaConfig::from_file("/nonexistent/gla.json"); }, {"/nonexistent/gla.json"});
}

// The Llama reader, given a GLA preset, says so instead of asking for Llama's fields.
TEST(GlaConfig, LlamaReaderNamesAGlaConfig) {
  expect_error([] { loom::LlamaConfig::from_file(config_path("gla-340m")); },
               {"gla-340m.json", "'model_type'", "GLA"});
}
