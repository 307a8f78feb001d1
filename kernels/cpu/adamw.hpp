#pragma once
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

struct AdamWArgs {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
  // Multiplies every gradient as it is read: gradient clipping's factor (clip_grad_scale), applied
  // in this pass instead of one more pass over the gradients. g * scale is the product
  // clip_grad_norm's in-place scaling stores, so the update is the same to the bit; the
  // gradients in memory stay unscaled.
  float grad_scale = 1;
};

// Fused AdamW (decoupled weight decay, PyTorch's formula) on fp32 master weights and moments.
// If param_bf16 is not null, also writes the updated weights rounded to bf16 there.
// The checks of adamw_step's arguments (every backend's AdamW runs them): a loom::Error naming the
// argument and its value.
void check_adamw_args(const AdamWArgs& a, int64_t n);
void adamw_step(const AdamWArgs& a, float* param, const float* grad, float* m, float* v, int64_t n,
                bf16* param_bf16 = nullptr);

}  // namespace loom::cpu
