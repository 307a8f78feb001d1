#pragma once
// The shape of a Llama model, read from a Hugging Face config.json.
#include <cstdint>
#include <string>

#include "ops/ops.hpp"  // RopeScaling

namespace loom {

struct LlamaConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads when absent
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000;
  RopeScaling rope_scaling;  // rope_scaling: null or {"rope_type": "llama3", ...}
  bool tie_word_embeddings = false;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }

  // Throws loom::Error naming `source` and the field for a missing field, a wrong type, or
  // inconsistent values (heads not dividing hidden size, kv heads not dividing heads, ...).
  static LlamaConfig from_json(const std::string& text, const std::string& source);
  static LlamaConfig from_file(const std::string& path);
  void validate(const std::string& source) const;
  std::string to_json() const;  // a Hugging Face config.json (architectures, model_type, ...)

  // Parameter count; with tied embeddings the shared matrix counts once.
  int64_t num_params() const;
  // Parameters excluding the input embedding (the output projection included): N of 6N.
  int64_t num_params_no_embedding() const;
  // Training FLOPs per token at sequence length T (torchtitan's convention: 6N + 12*L*H*Q*T).
  double flops_per_token(int64_t T) const;
};

}  // namespace loom
