#pragma once
// Generation with a KV cache: runs the weights of a LlamaModel (read in place, never copied)
// forward only. The prompt goes through in one pass (prefill), then one token at a time; each
// layer keeps the keys (after RoPE) and values of every position so far, so a new token costs
// one pass over the weights plus attention over the cache.
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/llama.hpp"

namespace loom {

class LlamaInference {
 public:
  // A cache of `max_len` positions (at most the model's max_position_embeddings) for batch 1.
  // The model must outlive this object; its weights are read at every forward.
  LlamaInference(LlamaModel& model, int64_t max_len);

  int64_t length() const { return len_; }  // positions in the cache
  int64_t max_len() const { return max_len_; }
  void reset() { len_ = 0; }  // forget the sequence (the cache is overwritten from position 0)

  // Appends `n` tokens at positions [length(), length() + n) and returns the logits [V] of the
  // last one, or with all_logits the logits [n, V] of every new position, on the model's device
  // (cpu or cuda: the cache and every buffer live there). The result is a view of an internal
  // buffer, valid until the next call.
  Tensor forward(const int32_t* tokens, int64_t n, bool all_logits = false);

 private:
  struct Layer {
    const ParamUnit* unit;
    Tensor k, v;  // [max_len, Hkv, hd]
  };
  // A GEMM input in the compute dtype: `x` itself in f32, else its rounding into `scratch`.
  Tensor gemm_input(const Tensor& x, Tensor& scratch) const;
  Tensor f32(const Shape& s) const;  // on the model's device

  const LlamaConfig& c_;
  DType compute_;
  Device device_;
  int64_t max_len_, len_ = 0;
  const ParamUnit* embed_;
  const ParamUnit* head_;
  std::vector<Layer> layers_;
  RopeTable rope_;
  std::vector<int32_t> positions_;
  Tensor logits_;
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
