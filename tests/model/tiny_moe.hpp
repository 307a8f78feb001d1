#pragma once
// The small mixtures of experts the tests build: the shape by name (designated initializers), RoPE
// theta 1e6, rms_norm_eps 1e-6 and 1024 positions; each test sets the routing and the loss's
// options it needs on the config that config() returns.
#include <cstdint>

#include "model/moe_config.hpp"

namespace loom::test {

struct TinyMoe {
  MoeConfig::Family family = MoeConfig::Family::qwen3_moe;
  int64_t hidden = 32, ffn = 48, layers = 3, heads = 4, kv_heads = 2, head_dim = 8;
  int64_t experts = 8, top_k = 2, moe_ffn = 16, vocab = 97;  // moe_ffn: not Mixtral's

  MoeConfig config() const {
    MoeConfig c;
    c.family = family;
    c.base.hidden_size = hidden;
    c.base.intermediate_size = ffn;  // the dense layers' (Mixtral: the experts')
    c.base.num_hidden_layers = layers;
    c.base.num_attention_heads = heads;
    c.base.num_key_value_heads = kv_heads;
    c.base.vocab_size = vocab;
    c.base.rms_norm_eps = 1e-6;
    c.base.rope_theta = 1000000;
    c.base.max_position_embeddings = 1024;
    c.head_dim = head_dim;
    c.num_experts = experts;
    c.num_experts_per_tok = top_k;
    // Mixtral's experts are its intermediate_size (config.json has no other field).
    c.moe_intermediate_size = family == MoeConfig::Family::mixtral ? ffn : moe_ffn;
    c.norm_topk_prob = true;
    return c;
  }
};

}  // namespace loom::test
