#pragma once
// The shape of a GLA (gated linear attention) model, read from a flash-linear-attention
// config.json (model_type "gla"), with fla's GLAConfig defaults for absent fields.
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct GlaConfig {
  int64_t hidden_size = 2048;
  double expand_k = 0.5;
  double expand_v = 1.0;
  double hidden_ratio = 4;
  int64_t intermediate_size = 0;  // derived from hidden_ratio when null in the file
  int64_t num_hidden_layers = 24;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 0;  // num_heads when null
  bool use_short_conv = false;
  int64_t conv_size = 4;
  bool use_output_gate = true;
  bool has_clamp_min = false;
  double clamp_min = 0;
  bool elementwise_affine = true;
  double norm_eps = 1e-6;
  bool fuse_norm = true;  // only renames the output norm (g_norm_swish_gate or g_norm)
  int64_t vocab_size = 32000;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  // Layer arguments fla's config never passes (always these in fla models); accepted as
  // extensions.
  double gate_logit_normalizer = 16;
  int64_t gate_low_rank_dim = 16;

  int64_t key_dim() const { return int64_t(double(hidden_size) * expand_k); }
  int64_t value_dim() const { return int64_t(double(hidden_size) * expand_v); }
  int64_t head_k_dim() const { return key_dim() / num_heads; }
  int64_t head_v_dim() const { return value_dim() / num_heads; }
  int64_t kv_groups() const { return num_heads / num_kv_heads; }
  // The output norm's name in fla: fused with the swish gate, or plain.
  std::string output_norm_name() const;

  // Throws loom::Error naming `source` and the field for a wrong type, an inconsistent value or
  // an fla option loom does not implement (hybrid attention layers, feature maps, l2warp, ...).
  static GlaConfig from_json(const std::string& text, const std::string& source);
  static GlaConfig from_file(const std::string& path);
  void validate(const std::string& source) const;
  std::string to_json() const;  // an fla config.json (architectures GLAForCausalLM)

  // fla's parameters by name with their global shapes (nn.Linear weights [out, in]), in the order
  // of the model: the embedding, each layer's, the final norm, then lm_head unless tied.
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<Param> params() const;
  int64_t num_params() const;  // with tied embeddings the shared matrix counts once
  // Training FLOPs per token: 6N (N: the parameters but the input embedding, the output
  // projection counted) plus the core in its recurrent form, forward 4 H dk dv per layer (the
  // state update k^T v and the read-out q S), backward twice that. Independent of T: the chunked
  // kernel's intra-chunk products are not counted, as Llama's convention counts attention's
  // scores and not the softmax.
  double flops_per_token(int64_t T) const;
};

}  // namespace loom
