#pragma once
// Generation with a KV cache for a LlamaModel (model/kv_cache.hpp: the prompt in one pass, then
// one token at a time, each layer's keys and values cached), and the sampler that draws the
// tokens from the logits.
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"

namespace loom {

class LlamaInference final : public KvCacheDecoder {
 public:
  // A cache of `max_len` positions (at most the model's max_position_embeddings) for batch 1.
  // The model must outlive this object; its weights are read at every forward.
  LlamaInference(LlamaModel& model, int64_t max_len);

 private:
  void run_layers(Tensor& x) override;

  const LlamaConfig& c_;
};

// Draws tokens from logits: temperature 0 is argmax; otherwise softmax(logits / temperature)
// restricted to the top-p set (the smallest set of most probable tokens whose probability mass
// is >= top_p), renormalized. Draw number n uses sample n of the seed's Philox stream, so a seed
// gives the same tokens on every machine and thread count.
class Sampler {
 public:
  Sampler(uint64_t seed, float temperature, float top_p);
  int32_t sample(const float* logits, int64_t V);

 private:
  uint64_t key_;
  int64_t draws_ = 0;
  float temperature_, top_p_;
  std::vector<float> probs_;
  std::vector<int32_t> order_;
};

// The first index of the largest value (NaN never wins); error if there is none finite.
int32_t argmax(const float* x, int64_t n);

// Indices of the top-p set of `probs` [n] (non-negative, summing to 1), most probable first,
// ties broken by the lower index. Always at least one token. `order` is scratch.
std::vector<int32_t> top_p_set(const float* probs, int64_t n, float top_p);

}  // namespace loom
