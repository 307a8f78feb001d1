#include "model/llama_config.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "model/gla_config.hpp"
#include "model/moe_config.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using loom::LlamaConfig;
using json = nlohmann::json;

namespace {

std::string source_dir() {
  // ctest sets LOOM_SOURCE_DIR; run by hand, the binary finds the tree from this file's path.
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

std::string config_path(const std::string& name) {
  return (fs::path(source_dir()) / "configs" / (name + ".json")).string();
}

using loom::test::expect_error;

// A small valid config as JSON, to be broken one field at a time.
json base() {
  return json{{"hidden_size", 64},        {"intermediate_size", 160}, {"num_hidden_layers", 2},
              {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"vocab_size", 512}};
}

void expect_bad(const json& j, const std::vector<std::string>& parts) {
  std::vector<std::string> all = parts;
  all.push_back("cfg.json");
  expect_error([&] { LlamaConfig::from_json(j.dump(), "cfg.json"); }, all);
}

}  // namespace

TEST(LlamaConfig, ReferenceParameterCounts) {
  struct Ref {
    const char* name;
    double published;  // REFERENCE.md, rounded as published
    int64_t exact;     // the count of the Hugging Face checkpoints
  };
  const Ref refs[] = {{"llama3.2-1b", 1.236e9, 1235814400},
                      {"llama3-8b", 8.030e9, 8030261248},
                      {"llama3-70b", 70.55e9, 70553706496},
                      {"llama3-405b", 405.85e9, 405853388800}};
  for (const auto& r : refs) {
    LlamaConfig c = LlamaConfig::from_file(config_path(r.name));
    EXPECT_LT(std::abs(double(c.num_params()) / r.published - 1), 1e-3) << r.name;
    EXPECT_EQ(c.num_params(), r.exact) << r.name;
  }
  LlamaConfig one_b = LlamaConfig::from_file(config_path("llama3.2-1b"));
  EXPECT_TRUE(one_b.tie_word_embeddings);
  EXPECT_EQ(one_b.head_dim(), 64);
  EXPECT_TRUE(one_b.rope_scaling.llama3);
  EXPECT_EQ(one_b.rope_scaling.factor, 32);
  EXPECT_EQ(one_b.rope_theta, 500000);
  EXPECT_EQ(one_b.rms_norm_eps, 1e-5);
}

TEST(LlamaConfig, FlopsPerTokenFollowsTorchtitan) {
  // Untied: N without the input embedding = N - V*d.
  LlamaConfig c = LlamaConfig::from_file(config_path("llama3-8b"));
  const int64_t Vd = 128256LL * 4096;
  EXPECT_EQ(c.num_params_no_embedding(), 8030261248LL - Vd);
  EXPECT_DOUBLE_EQ(c.flops_per_token(8192),
                   6.0 * double(8030261248LL - Vd) + 12.0 * 32 * 32 * 128 * 8192);
  // Tied: the shared matrix still does the output projection, so it stays in N.
  LlamaConfig t = LlamaConfig::from_file(config_path("llama3.2-1b"));
  EXPECT_EQ(t.num_params_no_embedding(), 1235814400LL);
  EXPECT_DOUBLE_EQ(t.flops_per_token(2048), 6.0 * 1235814400.0 + 12.0 * 16 * 32 * 64 * 2048);

  // A tiny model counted by hand: d=8, ffn=12, L=2, H=2, kv=1 (hd 4), V=10, untied.
  json j = {{"hidden_size", 8},         {"intermediate_size", 12},  {"num_hidden_layers", 2},
            {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"vocab_size", 10}};
  LlamaConfig s = LlamaConfig::from_json(j.dump(), "tiny");
  const int64_t layer = 64 + 32 + 32 + 64 + 3 * 96 + 16;  // q, k, v, o, mlp, norms
  EXPECT_EQ(s.num_params(), 80 + 2 * layer + 8 + 80);
  EXPECT_EQ(s.num_params_no_embedding(), 2 * layer + 8 + 80);
  EXPECT_DOUBLE_EQ(s.flops_per_token(16), 6.0 * (2 * layer + 88) + 12.0 * 2 * 2 * 4 * 16);
}

TEST(LlamaConfig, EveryShippedConfigParses) {
  const fs::path dir = fs::path(source_dir()) / "configs";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    std::ifstream f(e.path());
    const std::string type = json::parse(f).value("model_type", "");
    if (type == "gla") {  // a GLA preset, read by GlaConfig
      EXPECT_NO_THROW(loom::GlaConfig::from_file(e.path().string())) << e.path();
      continue;
    }
    if (type == "qwen3_moe" || type == "qwen2_moe" || type == "mixtral") {  // by MoeConfig
      EXPECT_NO_THROW(loom::MoeConfig::from_json(loom::read_file(e.path().string(), "config"),
                                                 e.path().string()))
          << e.path();
      continue;
    }
    EXPECT_NO_THROW(LlamaConfig::from_file(e.path().string())) << e.path();
    ++n;
  }
  EXPECT_GE(n, 7);

  LlamaConfig tiny = LlamaConfig::from_file(config_path("bench-tiny"));
  EXPECT_EQ(tiny.hidden_size, 288);
  EXPECT_EQ(tiny.num_hidden_layers, 6);
  EXPECT_EQ(tiny.num_attention_heads, 6);
  EXPECT_EQ(tiny.num_key_value_heads, 6);
  EXPECT_EQ(tiny.intermediate_size, 768);
  EXPECT_EQ(tiny.vocab_size, 4096);
  EXPECT_FALSE(tiny.tie_word_embeddings);
  EXPECT_EQ(tiny.rope_theta, 10000);
  EXPECT_EQ(tiny.max_position_embeddings, 2048);
  EXPECT_FALSE(tiny.rope_scaling.llama3);
  LlamaConfig small = LlamaConfig::from_file(config_path("bench-small"));
  EXPECT_EQ(small.hidden_size, 512);
  EXPECT_EQ(small.num_hidden_layers, 8);
  EXPECT_EQ(small.num_attention_heads, 8);
  EXPECT_EQ(small.num_key_value_heads, 4);
  EXPECT_EQ(small.intermediate_size, 1376);
  EXPECT_EQ(small.vocab_size, 8192);
  LlamaConfig dbg = LlamaConfig::from_file(config_path("debug"));
  EXPECT_EQ(dbg.hidden_size, 64);
  EXPECT_EQ(dbg.num_hidden_layers, 2);
  EXPECT_EQ(dbg.num_attention_heads, 4);
  EXPECT_EQ(dbg.num_key_value_heads, 2);
  EXPECT_EQ(dbg.intermediate_size, 160);
  EXPECT_EQ(dbg.vocab_size, 512);
}

TEST(LlamaConfig, DefaultsAndRopeScalingVariants) {
  json j = base();
  j.erase("num_key_value_heads");
  LlamaConfig c = LlamaConfig::from_json(j.dump(), "cfg.json");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.rope_theta, 10000);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);  // transformers' LlamaConfig default
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.rope_scaling.llama3);

  j["num_key_value_heads"] = nullptr;  // null means absent, as in transformers
  EXPECT_EQ(LlamaConfig::from_json(j.dump(), "cfg.json").num_key_value_heads, 4);

  // Older configs spell rope_type as "type"; numbers may be written as integers.
  j["rope_scaling"] = {{"type", "llama3"},
                       {"factor", 8},
                       {"low_freq_factor", 1.5},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 4096}};
  c = LlamaConfig::from_json(j.dump(), "cfg.json");
  EXPECT_TRUE(c.rope_scaling.llama3);
  EXPECT_EQ(c.rope_scaling.factor, 8);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.5);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4);
  EXPECT_EQ(c.rope_scaling.original_max_position, 4096);

  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_FALSE(LlamaConfig::from_json(j.dump(), "cfg.json").rope_scaling.llama3);
  j["head_dim"] = 16;
  EXPECT_EQ(LlamaConfig::from_json(j.dump(), "cfg.json").head_dim(), 16);
}

TEST(LlamaConfig, ToJsonIsHuggingFaceCompatibleAndRoundTrips) {
  for (const char* name : {"llama3-8b", "llama3.2-1b", "debug"}) {
    LlamaConfig c = LlamaConfig::from_file(config_path(name));
    const std::string text = c.to_json();
    json j = json::parse(text);
    EXPECT_EQ(j["architectures"], json::array({"LlamaForCausalLM"}));
    EXPECT_EQ(j["model_type"], "llama");
    EXPECT_EQ(j["hidden_act"], "silu");
    EXPECT_EQ(j["torch_dtype"], "float32");
    EXPECT_EQ(j["hidden_size"], c.hidden_size);
    EXPECT_EQ(j["num_key_value_heads"], c.num_key_value_heads);
    EXPECT_EQ(j["tie_word_embeddings"], c.tie_word_embeddings);
    EXPECT_EQ(j["rope_scaling"].is_null(), !c.rope_scaling.llama3);
    if (c.rope_scaling.llama3) {
      EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");
    }

    LlamaConfig r = LlamaConfig::from_json(text, "roundtrip");
    EXPECT_EQ(r.hidden_size, c.hidden_size);
    EXPECT_EQ(r.intermediate_size, c.intermediate_size);
    EXPECT_EQ(r.num_hidden_layers, c.num_hidden_layers);
    EXPECT_EQ(r.num_attention_heads, c.num_attention_heads);
    EXPECT_EQ(r.num_key_value_heads, c.num_key_value_heads);
    EXPECT_EQ(r.vocab_size, c.vocab_size);
    EXPECT_EQ(r.max_position_embeddings, c.max_position_embeddings);
    EXPECT_EQ(r.rms_norm_eps, c.rms_norm_eps);
    EXPECT_EQ(r.rope_theta, c.rope_theta);
    EXPECT_EQ(r.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(r.rope_scaling.llama3, c.rope_scaling.llama3);
    EXPECT_EQ(r.rope_scaling.factor, c.rope_scaling.factor);
    EXPECT_EQ(r.rope_scaling.low_freq_factor, c.rope_scaling.low_freq_factor);
    EXPECT_EQ(r.rope_scaling.high_freq_factor, c.rope_scaling.high_freq_factor);
    EXPECT_EQ(r.rope_scaling.original_max_position, c.rope_scaling.original_max_position);
  }
}

TEST(LlamaConfig, ErrorsNameTheFileAndField) {
  expect_error([] { LlamaConfig::from_json("{", "cfg.json"); }, {"cfg.json", "JSON"});
  expect_error([] { LlamaConfig::from_json("[1]", "cfg.json"); }, {"cfg.json", "object"});
  expect_error([] { LlamaConfig::from_file("/nonexistent/config.json"); },
               {"/nonexistent/config.json"});

  for (const char* f : {"hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "vocab_size"}) {
    json j = base();
    j.erase(f);
    expect_bad(j, {f, "missing"});
    j[f] = "64";
    expect_bad(j, {f, "integer", "string"});
    j[f] = 64.5;
    expect_bad(j, {f, "integer"});
    j[f] = 0;
    expect_bad(j, {f, "positive"});
    j[f] = -4;
    expect_bad(j, {f, "positive"});
  }
  json j = base();
  j["num_key_value_heads"] = 0;
  expect_bad(j, {"num_key_value_heads", "positive"});
  j = base();
  j["max_position_embeddings"] = -1;
  expect_bad(j, {"max_position_embeddings", "positive"});
  j = base();
  j["rms_norm_eps"] = "1e-5";
  expect_bad(j, {"rms_norm_eps", "number"});
  j = base();
  j["rms_norm_eps"] = 0;
  expect_bad(j, {"rms_norm_eps", "positive"});
  j = base();
  j["rope_theta"] = -1.0;
  expect_bad(j, {"rope_theta", "positive"});
  j = base();
  j["tie_word_embeddings"] = 1;
  expect_bad(j, {"tie_word_embeddings", "true or false"});

  j = base();
  j["num_attention_heads"] = 5;  // 64 % 5 != 0
  expect_bad(j, {"num_attention_heads", "divisor", "64"});
  j = base();
  j["num_key_value_heads"] = 3;  // 4 % 3 != 0
  expect_bad(j, {"num_key_value_heads", "divisor", "4"});
  j = base();
  j["hidden_size"] = 36;  // head_dim 9
  expect_bad(j, {"head_dim", "even", "9"});
  j = base();
  j["head_dim"] = 32;
  expect_bad(j, {"head_dim", "16", "32"});

  j = base();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  expect_bad(j, {"rope_scaling", "yarn", "llama3"});
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  expect_bad(j, {"rope_scaling", "linear", "llama3"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"low_freq_factor", 1.0}};
  expect_bad(j, {"rope_scaling.factor", "missing"});
  j["rope_scaling"] = 2.0;
  expect_bad(j, {"rope_scaling", "object"});
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 4.0},
                       {"high_freq_factor", 1.0},
                       {"original_max_position_embeddings", 8192}};
  expect_bad(j, {"high_freq_factor", "low < high"});

  j = base();
  j["hidden_act"] = "gelu";
  expect_bad(j, {"hidden_act", "silu", "gelu"});
  j = base();
  j["attention_bias"] = true;
  expect_bad(j, {"attention_bias", "false"});
}
