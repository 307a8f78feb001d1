#include "model/moe_config.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model/model_config.hpp"
#include "model/moe.hpp"
#include "tests/test_util.hpp"

using loom::MoeConfig;
using loom::test::expect_error;
using json = nlohmann::json;

namespace {

// Qwen3-30B-A3B's config.json (the fields that define the math).
json qwen3_30b_a3b() {
  return json{{"architectures", {"Qwen3MoeForCausalLM"}},
              {"model_type", "qwen3_moe"},
              {"hidden_size", 2048},
              {"intermediate_size", 6144},
              {"moe_intermediate_size", 768},
              {"num_hidden_layers", 48},
              {"num_attention_heads", 32},
              {"num_key_value_heads", 4},
              {"head_dim", 128},
              {"num_experts", 128},
              {"num_experts_per_tok", 8},
              {"norm_topk_prob", true},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", json::array()},
              {"router_aux_loss_coef", 0.001},
              {"output_router_logits", false},
              {"vocab_size", 151936},
              {"max_position_embeddings", 40960},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000000.0},
              {"rope_scaling", nullptr},
              {"tie_word_embeddings", false},
              {"use_sliding_window", false},
              {"sliding_window", nullptr},
              {"hidden_act", "silu"},
              {"attention_bias", false}};
}

// Mixtral-8x7B-v0.1's.
json mixtral_8x7b() {
  return json{{"architectures", {"MixtralForCausalLM"}},
              {"model_type", "mixtral"},
              {"hidden_size", 4096},
              {"intermediate_size", 14336},
              {"num_hidden_layers", 32},
              {"num_attention_heads", 32},
              {"num_key_value_heads", 8},
              {"num_local_experts", 8},
              {"num_experts_per_tok", 2},
              {"router_aux_loss_coef", 0.02},
              {"output_router_logits", false},
              {"vocab_size", 32000},
              {"max_position_embeddings", 32768},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 1000000.0},
              {"sliding_window", nullptr},
              {"tie_word_embeddings", false},
              {"hidden_act", "silu"}};
}

MoeConfig read(const json& j) {
  return MoeConfig::from_json(j.dump(), "cfg.json");
}

void expect_bad(const json& j, const std::vector<std::string>& parts) {
  std::vector<std::string> all{"cfg.json"};
  all.insert(all.end(), parts.begin(), parts.end());
  expect_error([&] { read(j); }, all);
}

}  // namespace

TEST(MoeConfig, Qwen3Moe30bA3bMatchesItsPublishedSize) {
  const MoeConfig c = read(qwen3_30b_a3b());
  EXPECT_EQ(c.family, MoeConfig::Family::qwen3_moe);
  EXPECT_EQ(c.head_dim, 128);  // not 2048 / 32
  EXPECT_TRUE(c.qk_norm());
  EXPECT_EQ(c.num_sparse_layers(), 48);
  // Published: 30.5B parameters, 3.3B activated.
  EXPECT_NEAR(double(c.num_params()) / 1e9, 30.5, 0.05);
  EXPECT_NEAR(double(c.num_active_params()) / 1e9, 3.3, 0.06);
}

TEST(MoeConfig, Mixtral8x7bMatchesItsPublishedSize) {
  const MoeConfig c = read(mixtral_8x7b());
  EXPECT_EQ(c.family, MoeConfig::Family::mixtral);
  EXPECT_FALSE(c.qk_norm());
  EXPECT_TRUE(c.norm_topk_prob);  // Mixtral always renormalizes
  EXPECT_EQ(c.moe_intermediate_size, 14336);
  EXPECT_EQ(c.head_dim, 128);
  // Published: 46.7B parameters, 12.9B active.
  EXPECT_NEAR(double(c.num_params()) / 1e9, 46.7, 0.05);
  EXPECT_NEAR(double(c.num_active_params()) / 1e9, 12.9, 0.05);
}

// Qwen1.5-MoE-A2.7B's (model_type qwen2_moe): q/k/v biases and a shared expert.
json qwen2_moe_a27b() {
  return json{{"architectures", {"Qwen2MoeForCausalLM"}},
              {"model_type", "qwen2_moe"},
              {"hidden_size", 2048},
              {"intermediate_size", 5632},
              {"moe_intermediate_size", 1408},
              {"shared_expert_intermediate_size", 5632},
              {"num_hidden_layers", 24},
              {"num_attention_heads", 16},
              {"num_key_value_heads", 16},
              {"num_experts", 60},
              {"num_experts_per_tok", 4},
              {"norm_topk_prob", false},
              {"decoder_sparse_step", 1},
              {"router_aux_loss_coef", 0.001},
              {"vocab_size", 151936},
              {"max_position_embeddings", 8192},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000000.0},
              {"tie_word_embeddings", false},
              {"use_sliding_window", false},
              {"hidden_act", "silu"}};
}

TEST(MoeConfig, Qwen2MoeA27bMatchesItsPublishedSize) {
  const MoeConfig c = read(qwen2_moe_a27b());
  EXPECT_EQ(c.family, MoeConfig::Family::qwen2_moe);
  EXPECT_TRUE(c.qkv_bias());
  EXPECT_FALSE(c.qk_norm());
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  // Published: 14.3B parameters, 2.7B activated.
  EXPECT_NEAR(double(c.num_params()) / 1e9, 14.3, 0.05);
  EXPECT_NEAR(double(c.num_active_params()) / 1e9, 2.7, 0.05);
  json j = qwen2_moe_a27b();
  j["head_dim"] = 64;
  expect_bad(j, {"head_dim", "128"});
  j = qwen2_moe_a27b();
  j.erase("shared_expert_intermediate_size");  // transformers' default
  EXPECT_EQ(read(j).shared_expert_intermediate_size, 5632);
}

TEST(MoeConfig, SparseLayersFollowTransformersRule) {
  json j = qwen3_30b_a3b();
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  const MoeConfig c = read(j);
  // (l + 1) % 2 == 0 and l not in {3}: layers 1 and 5.
  std::vector<bool> want{false, true, false, false, false, true};
  for (int64_t l = 0; l < 6; ++l) EXPECT_EQ(c.sparse(l), want[size_t(l)]) << l;
  EXPECT_EQ(c.num_sparse_layers(), 2);
}

TEST(MoeConfig, RoundTripsThroughItsJson) {
  for (const json& j : {qwen3_30b_a3b(), qwen2_moe_a27b(), mixtral_8x7b()}) {
    const MoeConfig a = read(j);
    const MoeConfig b = MoeConfig::from_json(a.to_json(), "again.json");
    EXPECT_EQ(a.to_json(), b.to_json());
    EXPECT_EQ(a.num_params(), b.num_params());
    EXPECT_EQ(json::parse(a.to_json())["model_type"], j["model_type"]);
  }
  // ModelConfig dispatches on model_type.
  const loom::ModelConfig m = loom::ModelConfig::from_json(mixtral_8x7b().dump(), "m.json");
  EXPECT_TRUE(m.is_moe());
  EXPECT_STREQ(m.model_type(), "mixtral");
  EXPECT_EQ(m.vocab_size(), 32000);
  expect_error([&] { m.llama("loom generate"); }, {"loom generate", "Llama", "mixtral"});
}

TEST(MoeConfig, BadInputNamesTheField) {
  json j = qwen3_30b_a3b();
  j["num_experts_per_tok"] = 129;
  expect_bad(j, {"num_experts_per_tok", "128", "129"});
  j = qwen3_30b_a3b();
  j.erase("head_dim");
  expect_bad(j, {"head_dim", "missing"});
  j = qwen3_30b_a3b();
  j["use_sliding_window"] = true;
  expect_bad(j, {"use_sliding_window"});
  j = qwen3_30b_a3b();
  j["mlp_only_layers"] = {48};
  expect_bad(j, {"mlp_only_layers", "48"});
  j = qwen3_30b_a3b();
  j["shared_expert_intermediate_size"] = 512;
  expect_bad(j, {"shared_expert_intermediate_size", "qwen2_moe"});
  j = qwen3_30b_a3b();
  j["attention_bias"] = true;
  expect_bad(j, {"attention_bias"});
  j = qwen3_30b_a3b();
  j["num_experts"] = 0;
  expect_bad(j, {"num_experts"});
  j = mixtral_8x7b();
  j["sliding_window"] = 4096;
  expect_bad(j, {"sliding_window", "4096"});
  j = mixtral_8x7b();
  j.erase("num_local_experts");
  expect_bad(j, {"num_local_experts"});
  j = qwen3_30b_a3b();
  j["model_type"] = "deepseek_v3";
  expect_error([&] { read(j); }, {"cfg.json", "model_type", "deepseek_v3"});
  // Read through the model-type dispatch, a mixture of another type is not taken for a Llama.
  expect_error([&] { loom::ModelConfig::from_json(j.dump(), "cfg.json"); },
               {"cfg.json", "num_experts", "deepseek_v3", "qwen2_moe"});
}

TEST(MoeConfig, BuiltModelHoldsTheCountedParameters) {
  json j = qwen3_30b_a3b();
  j["hidden_size"] = 64;
  j["intermediate_size"] = 96;
  j["moe_intermediate_size"] = 32;
  j["num_hidden_layers"] = 3;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 2;
  j["head_dim"] = 24;
  j["num_experts"] = 6;
  j["num_experts_per_tok"] = 2;
  j["mlp_only_layers"] = {0};
  j["vocab_size"] = 300;
  for (bool tied : {false, true}) {
    j["tie_word_embeddings"] = tied;
    const MoeConfig c = read(j);
    loom::MoeModel m(c, loom::DType::f32, loom::Device::meta);
    EXPECT_EQ(m.num_params(), c.num_params()) << "tied " << tied;
  }
  json q2 = j;
  q2["model_type"] = "qwen2_moe";
  q2["head_dim"] = 16;
  q2["shared_expert_intermediate_size"] = 40;
  const MoeConfig c2 = read(q2);
  loom::MoeModel m2(c2, loom::DType::f32, loom::Device::meta);
  EXPECT_EQ(m2.num_params(), c2.num_params());
}
