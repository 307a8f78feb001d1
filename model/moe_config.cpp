#include "model/moe_config.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "model/config_json.hpp"

namespace loom {

namespace {

using namespace config_json;

}  // namespace

const char* MoeConfig::model_type() const {
  switch (family) {
    case Family::qwen3_moe:
      return "qwen3_moe";
    case Family::qwen2_moe:
      return "qwen2_moe";
    case Family::mixtral:
      return "mixtral";
  }
  return "?";
}

std::string MoeConfig::expert_param(int64_t layer, int64_t expert, ExpertMatrix m) const {
  static constexpr const char* kQwen[] = {"gate_proj", "up_proj", "down_proj"};
  static constexpr const char* kMixtral[] = {"w1", "w3", "w2"};
  const char* w = (family == Family::mixtral ? kMixtral : kQwen)[int(m)];
  return "model.layers." + std::to_string(layer) + "." + moe_prefix() + "experts." +
         std::to_string(expert) + "." + w + ".weight";
}

bool MoeConfig::sparse(int64_t layer) const {
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
    return false;
  return num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

int64_t MoeConfig::num_sparse_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < base.num_hidden_layers; ++l) n += sparse(l);
  return n;
}

MoeConfig MoeConfig::from_json(const std::string& text, const std::string& source) {
  json j = parse_object(text, source, "a Hugging Face config.json");
  LOOM_CHECK(present(j, "model_type") && j["model_type"].is_string(), source,
             ": missing field 'model_type' (expected \"qwen3_moe\", \"qwen2_moe\" or \"mixtral\")");
  MoeConfig c;
  const std::string type = j["model_type"].get<std::string>();
  if (type == "mixtral")
    c.family = Family::mixtral;
  else if (type == "qwen2_moe")
    c.family = Family::qwen2_moe;
  else
    LOOM_CHECK(type == "qwen3_moe", source, ": field 'model_type': expected \"qwen3_moe\", ",
               "\"qwen2_moe\" or \"mixtral\", found \"", type, "\"");

  // Sliding-window attention would load silently and be wrong: loom's attention is full causal.
  if (present(j, "use_sliding_window"))
    LOOM_CHECK(!get_bool(j, "use_sliding_window", source, "use_sliding_window"), source,
               ": field 'use_sliding_window': expected false (loom's attention is full causal)");
  if (c.family == Family::mixtral)
    LOOM_CHECK(!present(j, "sliding_window"), source,
               ": field 'sliding_window': expected null (loom's attention is full causal), found ",
               found(j["sliding_window"]));

  // The attention, embedding and head as a Llama reads them; head_dim is the family's own.
  json llama = j;
  for (const char* k : {"head_dim", "num_experts", "num_local_experts", "moe_intermediate_size"})
    llama.erase(k);
  c.base = LlamaConfig::from_json(llama.dump(), source);
  if (c.family != Family::mixtral) {
    if (c.family == Family::qwen3_moe) {
      // transformers' Qwen3-MoE takes head_dim from the file; a default could silently differ.
      LOOM_CHECK(present(j, "head_dim"), source,
                 ": missing required field 'head_dim' (expected a positive even integer)");
      c.head_dim = get_int(j, "head_dim", source, "head_dim");
    } else {
      // Qwen2-MoE's attention takes hidden_size / num_attention_heads.
      c.head_dim = c.base.head_dim();
      if (present(j, "head_dim"))
        LOOM_CHECK(get_int(j, "head_dim", source, "head_dim") == c.head_dim, source,
                   ": field 'head_dim': expected hidden_size / num_attention_heads = ", c.head_dim,
                   " (Qwen2-MoE's), found ", j["head_dim"].dump());
      // transformers' default; Qwen2-MoE always has its shared expert.
      c.shared_expert_intermediate_size = 5632;
    }
    c.num_experts = required_int(j, "num_experts", source);
    c.num_experts_per_tok = required_int(j, "num_experts_per_tok", source);
    c.moe_intermediate_size = required_int(j, "moe_intermediate_size", source);
    read(j, "norm_topk_prob", source, c.norm_topk_prob);
    read(j, "decoder_sparse_step", source, c.decoder_sparse_step);
    if (c.family == Family::qwen2_moe)
      read(j, "shared_expert_intermediate_size", source, c.shared_expert_intermediate_size);
    else if (present(j, "shared_expert_intermediate_size"))
      // transformers' Qwen3-MoE has none and ignores the key: a model that asks for one would load
      // there without it.
      LOOM_CHECK(get_int(j, "shared_expert_intermediate_size", source,
                         "shared_expert_intermediate_size") == 0,
                 source,
                 ": field 'shared_expert_intermediate_size': qwen3_moe has no shared expert ",
                 "(Qwen2-MoE's is model_type \"qwen2_moe\"; expected 0 or absent)");
    if (present(j, "mlp_only_layers")) {
      const json& v = j["mlp_only_layers"];
      LOOM_CHECK(v.is_array(), source,
                 ": field 'mlp_only_layers': expected a list of layer indices, found ", found(v));
      for (size_t i = 0; i < v.size(); ++i)
        c.mlp_only_layers.push_back(
            to_int(v[i], source, "mlp_only_layers[" + std::to_string(i) + "]"));
    }
  } else {
    c.head_dim =
        present(j, "head_dim") ? get_int(j, "head_dim", source, "head_dim") : c.base.head_dim();
    c.num_experts = required_int(j, "num_local_experts", source);
    c.num_experts_per_tok = required_int(j, "num_experts_per_tok", source);
    c.moe_intermediate_size = c.base.intermediate_size;
    c.norm_topk_prob = true;
    c.router_aux_loss_coef = 0.02;  // MixtralConfig's default
  }
  read(j, "router_aux_loss_coef", source, c.router_aux_loss_coef);
  read(j, "output_router_logits", source, c.output_router_logits);
  read(j, "loom_expert_bias", source, c.expert_bias);
  c.validate(source);
  return c;
}

void MoeConfig::validate(const std::string& source) const {
  base.validate(source);
  auto positive = [&](int64_t v, const char* field) {
    LOOM_CHECK(v > 0, source, ": field '", field, "': expected a positive integer, found ", v);
  };
  const bool q = family != Family::mixtral;
  positive(head_dim, "head_dim");
  LOOM_CHECK(head_dim % 2 == 0, source, ": field 'head_dim': expected an even number for RoPE, ",
             "found ", head_dim);
  positive(num_experts, q ? "num_experts" : "num_local_experts");
  positive(num_experts_per_tok, "num_experts_per_tok");
  positive(moe_intermediate_size, q ? "moe_intermediate_size" : "intermediate_size");
  positive(decoder_sparse_step, "decoder_sparse_step");
  LOOM_CHECK(num_experts_per_tok <= num_experts, source,
             ": field 'num_experts_per_tok': ", "expected at most the ", num_experts, " experts (",
             q ? "num_experts" : "num_local_experts", "), found ", num_experts_per_tok);
  for (int64_t l : mlp_only_layers)
    LOOM_CHECK(l >= 0 && l < base.num_hidden_layers, source, ": field 'mlp_only_layers': layer ", l,
               " is not one of the ", base.num_hidden_layers, " layers");
  if (family == Family::qwen2_moe)
    positive(shared_expert_intermediate_size, "shared_expert_intermediate_size");
  else
    LOOM_CHECK(
        shared_expert_intermediate_size == 0, source,
        ": field 'shared_expert_intermediate_size': only qwen2_moe has a shared expert, found ",
        shared_expert_intermediate_size);
  LOOM_CHECK(router_aux_loss_coef >= 0, source,
             ": field 'router_aux_loss_coef': expected a number >= 0, found ",
             router_aux_loss_coef);
}

std::string MoeConfig::to_json() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(base.to_json());
  const bool q = family != Family::mixtral;
  j["architectures"] = {family == Family::qwen3_moe   ? "Qwen3MoeForCausalLM"
                        : family == Family::qwen2_moe ? "Qwen2MoeForCausalLM"
                                                      : "MixtralForCausalLM"};
  j["model_type"] = model_type();
  j["head_dim"] = head_dim;
  j.erase("mlp_bias");
  if (q) {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["use_sliding_window"] = false;
    if (family == Family::qwen2_moe)
      j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  } else {
    j["num_local_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["sliding_window"] = nullptr;
  }
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["output_router_logits"] = output_router_logits;
  if (expert_bias) j["loom_expert_bias"] = true;
  return j.dump(2) + "\n";
}

double MoeConfig::load_warning_threshold() const {
  if (training.load_warning > 0) return training.load_warning;
  return (1.0 + double(num_experts) / double(num_experts_per_tok)) / 2.0;
}

int64_t MoeConfig::num_params() const {
  const int64_t d = base.hidden_size, V = base.vocab_size, L = base.num_hidden_layers;
  const int64_t Ls = num_sparse_layers();
  const int64_t qkv = (base.num_attention_heads + 2 * base.num_key_value_heads) * head_dim;
  const int64_t attn = d * qkv + base.num_attention_heads * head_dim * d + 2 * d +
                       (qk_norm() ? 2 * head_dim : 0) + (qkv_bias() ? qkv : 0);
  const int64_t dense = 3 * d * base.intermediate_size;
  const int64_t shared = shared_expert_intermediate_size > 0
                             ? 3 * d * shared_expert_intermediate_size + d  // and its gate
                             : 0;
  const int64_t moe = num_experts * d + num_experts * 3 * d * moe_intermediate_size + shared +
                      (expert_bias ? num_experts : 0);
  return V * d + L * attn + (L - Ls) * dense + Ls * moe + d +
         (base.tie_word_embeddings ? 0 : V * d);
}

int64_t MoeConfig::num_active_params() const {
  const int64_t idle = num_experts - num_experts_per_tok;
  return num_params() - num_sparse_layers() * idle * 3 * base.hidden_size * moe_intermediate_size;
}

double MoeConfig::flops_per_token(int64_t T) const {
  // The output projection does the work of a V x d GEMM whether or not its matrix is shared.
  const int64_t Vd = base.vocab_size * base.hidden_size;
  const int64_t n = num_active_params() - Vd + (base.tie_word_embeddings ? Vd : 0);
  return 6.0 * double(n) + 12.0 * double(base.num_hidden_layers) *
                               double(base.num_attention_heads) * double(head_dim) * double(T);
}

}  // namespace loom
