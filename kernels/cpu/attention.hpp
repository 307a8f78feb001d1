#pragma once
// Causal grouped-query attention computed flash-style: query tiles against key tiles with an
// online softmax, so the T x T score matrix never exists whole. Saves the row log-sum-exp for
// backward, which recomputes the scores tile by tile. Implemented by the block kernels of
// attention_block.hpp with positions 0..T-1 (one kernel for plain and ring attention).
#include <cstdint>

namespace loom::cpu {

// Layouts are token-major, as the fused qkv GEMM writes them:
//   q[b, t, h, :]   at q + (b*T + t)*q_stride + h*D        (h < Hq)
//   k/v[b, t, g, :] at k + (b*T + t)*kv_stride + g*D       (g < Hkv; head h uses g = h / (Hq/Hkv))
//   out[b, t, h, :] at out + (b*T + t)*Hq*D + h*D          (contiguous)
//   lse[b, h, t]    at lse + (b*Hq + h)*T + t
struct AttentionShape {
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0;
  int64_t q_stride = 0, kv_stride = 0;  // floats between consecutive tokens of q and of k/v
  float scale = 0;                      // usually 1/sqrt(D)
};

void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse);

// dq, dk, dv have the layouts (and strides) of q, k, v; they are overwritten.
void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv);

}  // namespace loom::cpu
