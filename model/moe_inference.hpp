#pragma once
// Generation with a KV cache for a mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral:
// model/moe.hpp), as Llama's (model/kv_cache.hpp: the prompt in one pass, then one token at a
// time, each layer's keys and values cached). Each layer runs its attention block's branches on
// the chunk of new tokens: the attention with the family's options (Qwen3's q/k norms, Qwen2-MoE's
// q/k/v biases, head_dim free of hidden / heads) against the cache, then a dense layer's MLP or a
// sparse layer's router (top-k, renormalized as the config says; Qwen2-MoE's shared expert with
// its sigmoid gate) and the chosen experts, the very functions the training forward runs
// (model/moe_ffn.hpp). The model is built whole on one process (no expert parallelism: every
// expert here); a checkpoint saved under any layout loads into it (the experts are under their
// global names).
#include <cstdint>

#include "core/tensor.hpp"
#include "model/kv_cache.hpp"
#include "model/moe.hpp"

namespace loom {

class MoeInference final : public KvCacheDecoder {
 public:
  // A cache of `max_len` positions (at most the model's max_position_embeddings) for batch 1.
  // The model must outlive this object; its weights are read at every forward.
  MoeInference(MoeModel& model, int64_t max_len);

 private:
  void run_layers(Tensor& x) override;

  MoeModel& model_;
  const MoeConfig& c_;
};

}  // namespace loom
