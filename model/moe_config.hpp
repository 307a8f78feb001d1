#pragma once
// The shape of a mixture-of-experts model, read from a Hugging Face config.json of model_type
// "qwen3_moe" (Qwen3-MoE: q/k norms, mlp_only_layers / decoder_sparse_step for dense layers,
// norm_topk_prob), "qwen2_moe" (Qwen2-MoE / Qwen1.5-MoE: the same routing and layer rule, q/k/v
// projection biases and a shared expert with a sigmoid gate, no q/k norms) or "mixtral" (every
// layer sparse, top-k always renormalized). The attention,
// embedding, dense FFN and head are a Llama's (`base`), with head_dim free of hidden_size /
// num_attention_heads (Qwen3's 128 beside hidden 2048 and 32 heads). docs/decisions/moe.md.
#include <cstdint>
#include <string>
#include <vector>

#include "model/llama_config.hpp"

namespace loom {

struct MoeConfig {
  enum class Family { qwen3_moe, qwen2_moe, mixtral };
  Family family = Family::qwen3_moe;
  // The attention and dense parts. base.intermediate_size is the dense layers' FFN (Qwen3's
  // mlp_only_layers; Mixtral has none: its intermediate_size is the experts').
  LlamaConfig base;
  int64_t head_dim = 0;
  int64_t num_experts = 0;            // qwen3_moe's num_experts, mixtral's num_local_experts
  int64_t num_experts_per_tok = 0;    // k
  int64_t moe_intermediate_size = 0;  // each expert's FFN
  // Qwen2-MoE's shared expert, in every sparse layer (0: none, the other families).
  int64_t shared_expert_intermediate_size = 0;
  bool norm_topk_prob = false;  // renormalize the top-k weights (mixtral: always)
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  // Whether training adds router_aux_loss_coef x the load-balancing loss (transformers' switch).
  bool output_router_logits = false;
  // DeepSeek-V3's selection-only bias per sparse layer (`<moe_prefix>gate.e_score_correction_bias`
  // [E], f32): added to the probabilities to choose the top-k, never to the weights. loom's own
  // field "loom_expert_bias" in config.json (written only when true: transformers' Qwen-MoE and
  // Mixtral have no such bias and ignore the field). A job with moe.bias_update_rate > 0 turns it
  // on.
  bool expert_bias = false;

  // loom's training options of the experts: the job's [moe] section (train/launch.hpp
  // job_model_config), never read from or written to config.json.
  struct Training {
    double capacity_factor = 0;   // 0: dropless (model/moe_capacity.hpp)
    double bias_update_rate = 0;  // the bias's step after each optimizer step; 0: it stays
    double load_warning = 0;      // a layer's load max/mean that is warned about; 0: the default
  } training;
  // The load max/mean past which a layer is warned about: training.load_warning, or by default
  // halfway between balanced (1) and every token's first choice on one expert (E / k).
  double load_warning_threshold() const;

  const char* model_type() const;
  bool qk_norm() const { return family == Family::qwen3_moe; }
  bool qkv_bias() const { return family == Family::qwen2_moe; }
  // The names' prefix of a sparse layer's experts branch: "mlp." or Mixtral's "block_sparse_moe.".
  const char* moe_prefix() const {
    return family == Family::mixtral ? "block_sparse_moe." : "mlp.";
  }
  // The global name of one of an expert's matrices (Mixtral's w1, w3, w2 for gate, up, down).
  enum class ExpertMatrix { gate, up, down };
  std::string expert_param(int64_t layer, int64_t expert, ExpertMatrix m) const;
  // Whether layer `l` has the experts (else a dense SwiGLU MLP): transformers' rule.
  bool sparse(int64_t layer) const;
  int64_t num_sparse_layers() const;

  // Throws loom::Error naming `source` and the field, as LlamaConfig's reader does; refuses the
  // variants loom does not build (a shared expert, sliding windows, biases) by name.
  static MoeConfig from_json(const std::string& text, const std::string& source);
  void validate(const std::string& source) const;
  std::string to_json() const;

  // Every parameter; and those one token's forward reads (the k chosen experts of each sparse
  // layer): MFU counts the active ones (6 * active N).
  int64_t num_params() const;
  int64_t num_active_params() const;
  // Training FLOPs per token at sequence length T: 6 x the active parameters without the input
  // embedding, plus attention's 12 * L * H * hd * T (torchtitan's convention).
  double flops_per_token(int64_t T) const;
};

}  // namespace loom
