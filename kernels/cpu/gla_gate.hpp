#pragma once
// GLA's log-decay from the low-rank gate's logits (the GEMMs gk_proj.0 and gk_proj.1 run before):
//   gk = max(logsigmoid(z) / normalizer, clamp_min)
// fla fixes normalizer = 16; clamp_min is a config option (-inf when unset).
#include <cstdint>

namespace loom::cpu {

// z and gk are [rows, width], contiguous; gk may be z (in place).
void gla_gate_forward(const float* z, int64_t rows, int64_t width, float normalizer,
                      float clamp_min, float* gk);
// dz = dgk * sigmoid(-z) / normalizer where the clamp let z through (PyTorch's clamp_min passes
// the gradient where the value is >= clamp_min), 0 elsewhere; dz [rows, width] overwritten, may be
// dgk.
void gla_gate_backward(const float* dgk, const float* z, int64_t rows, int64_t width,
                       float normalizer, float clamp_min, float* dz);

}  // namespace loom::cpu
