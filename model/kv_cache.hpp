#pragma once
// What generation with a KV cache shares between the families with softmax attention
// (model/llama_inference.hpp, model/moe_inference.hpp): batch 1, the weights of the model read in
// place (never copied), forward only. The prompt goes through in one pass (prefill), then one
// token at a time; each layer keeps the keys (after RoPE) and values of every position so far, so
// a new token costs one pass over the weights plus attention over the cache. A family supplies
// its layers (`run_layers`); the embedding, the positions, the cached attention, the rounding of
// GEMM inputs and the head's logits are here. Every buffer lives on the model's device.
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/llama_config.hpp"
#include "model/model.hpp"
#include "ops/ops.hpp"

namespace loom {

class KvCacheDecoder {
 public:
  virtual ~KvCacheDecoder() = default;
  KvCacheDecoder(const KvCacheDecoder&) = delete;
  KvCacheDecoder& operator=(const KvCacheDecoder&) = delete;

  int64_t length() const { return len_; }  // positions in the cache
  int64_t max_len() const { return max_len_; }
  void reset() { len_ = 0; }  // forget the sequence (the cache is overwritten from position 0)

  // Appends `n` tokens at positions [length(), length() + n) and returns the logits [V] of the
  // last one, or with all_logits the logits [n, V] of every new position, on the model's device
  // (cpu or cuda). The result is a view of an internal buffer, valid until the next call.
  Tensor forward(const int32_t* tokens, int64_t n, bool all_logits = false);

 protected:
  // `c`: the attention, embedding and head's shape (head_dim given apart: the MoE families' is
  // free of hidden / heads). A cache of `max_len` positions (at most max_position_embeddings) per
  // layer. The model must outlive this object; it must have all its units whole on a device
  // where kernels run (error otherwise, naming the unit).
  KvCacheDecoder(Model& model, const LlamaConfig& c, int64_t head_dim, int64_t max_len);

  // x [n, d] f32, the chunk's residual stream after the embedding: through every layer (x may be
  // replaced by a new tensor).
  virtual void run_layers(Tensor& x) = 0;

  // Layer l's attention of the chunk: q and k of `qkv` (the f32 output of the fused q/k/v GEMM
  // [n, (Hq + 2 Hkv) hd], biases and norms applied) rotated in place, k and v appended to the
  // cache, then q over every cached position into attn [n, Hq hd] (f32).
  void attend(size_t layer, Tensor& qkv, Tensor& attn);
  // A GEMM input in the compute dtype: `x` itself in f32, else its rounding into a scratch buffer
  // (valid until the next call).
  Tensor gemm_input(const Tensor& x);
  Tensor f32(const Shape& s) const;  // on the model's device
  // The model's units in order: embedding, blocks, head.
  const std::vector<ParamUnit*>& units() const { return units_; }

  const DType compute_;
  const Device device_;

 private:
  struct Cache {
    Tensor k, v;  // [max_len, Hkv hd]
  };
  const LlamaConfig& c_;
  const int64_t hd_, max_len_;
  int64_t len_ = 0, n_ = 0;  // n_: the chunk being run
  std::vector<ParamUnit*> units_;
  std::vector<Cache> caches_;
  ops::Rope rope_;
  Tensor positions_;          // int32 [n_] on the device: the chunk's positions
  Tensor lo_, lse_, logits_;  // lo_: rounded GEMM inputs (bf16)
};

}  // namespace loom
