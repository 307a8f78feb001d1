#pragma once
// Generation for GLA with a recurrent state instead of a KV cache: each layer keeps its state
// S [H, K, V] (and, with the short convolution, the last conv_size - 1 rows of q | k | v before
// the convolution), so a new token costs one pass over the weights and O(K V) per head,
// whatever the length so far. Runs the weights of a GlaModel in place, forward only, batch 1.
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/gla.hpp"

namespace loom {

class GlaInference {
 public:
  // The model must outlive this object; its weights are read at every forward.
  explicit GlaInference(GlaModel& model);

  int64_t length() const { return len_; }  // tokens consumed so far
  void reset();                            // back to the zero state

  // Consumes `n` tokens (any n: the chunked kernel runs from the saved state) and returns the
  // logits [V] of the last one, or with all_logits the logits [n, V] of every new token, on the
  // model's device (cpu or cuda: the state and every buffer live there). The result is valid
  // until the next call.
  Tensor forward(const int32_t* tokens, int64_t n, bool all_logits = false);

 private:
  struct Layer {
    const GlaBlock* block;
    Tensor S;     // [1, H, K, V]
    Tensor conv;  // [conv_size - 1, Kd + Kd/G + Vd/G] pre-convolution rows (use_short_conv)
  };
  Tensor f32(const Shape& s) const;  // on the model's device

  GlaModel& model_;
  const GlaConfig& c_;
  int64_t len_ = 0;
  std::vector<Layer> layers_;
  Tensor logits_;
};

}  // namespace loom
