#pragma once
// Attention of a few new query positions against a KV cache, for generation. The Tq queries are
// the last Tq of L positions whose keys and values are in the cache, so query i sees keys
// [0, L - Tq + i]: causal, offset by the L - Tq positions that were already there. Grouped-query:
// head h reads kv head h / (Hq / Hkv).
#include <cstdint>

namespace loom::cpu {

struct DecodeShape {
  int64_t Tq = 0;  // new query positions
  int64_t L = 0;   // positions in the cache, the new ones included (L >= Tq)
  int64_t Hq = 0, Hkv = 0, D = 0;
  int64_t q_stride = 0;   // floats between consecutive queries (>= Hq*D)
  int64_t kv_stride = 0;  // floats between consecutive cache positions (>= Hkv*D)
  float scale = 0;        // usually 1/sqrt(D)
};

// Layouts:
//   q[i, h, :]    at q + i*q_stride + h*D       (i < Tq, h < Hq)
//   k/v[j, g, :]  at k + j*kv_stride + g*D      (j < L, g < Hkv)
//   out[i, h, :]  at out + i*Hq*D + h*D         (contiguous, overwritten)
void attention_decode(const DecodeShape& s, const float* q, const float* k, const float* v,
                      float* out);

}  // namespace loom::cpu
