#pragma once
// GLA's log-decay from the low-rank gate's logits (the GEMMs gk_proj.0 and gk_proj.1 run before):
//   gk = max(logsigmoid(z + bias) / normalizer, clamp_min)
// with gk_proj.1's bias [width] (null: none) added here rather than by a GEMM. fla fixes
// normalizer = 16; clamp_min is a config option (-inf when unset).
#include <cstdint>

namespace loom::cpu {

// z and gk are [rows, width], contiguous; gk may be z (in place).
void gla_gate_forward(const float* z, const float* bias, int64_t rows, int64_t width,
                      float normalizer, float clamp_min, float* gk);
// dz = dgk * sigmoid(-(z + bias)) / normalizer where the clamp let the value through (PyTorch's
// clamp_min passes the gradient where the value is >= clamp_min), 0 elsewhere; dz [rows, width]
// overwritten, may be dgk. dbias [width] (with bias) accumulates the column sums of dz, with the
// same bits for any thread count.
void gla_gate_backward(const float* dgk, const float* z, const float* bias, int64_t rows,
                       int64_t width, float normalizer, float clamp_min, float* dz, float* dbias);

}  // namespace loom::cpu
