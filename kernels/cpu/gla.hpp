#pragma once
// The GLA core (gated linear attention, docs/decisions/gla.md): per sample and query head h, with
// kv head g = h / (H / Hkv), the recurrence
//   S_t = Diag(exp(gk_t)) S_{t-1} + k_t v_t^T      (S in R^{K x V}, S_0 = h0 or 0)
//   o_t = scale * S_t^T q_t
// computed chunk by chunk. Within a chunk the decay between two tokens is exp(b_r - b_j) with b the
// chunk-local inclusive cumsum of gk; it is never factored as exp(b_r) * exp(-b_j) (exp(-b)
// overflows f32 under strong decay). Sub-chunk pairs use a reference row so both factors are <= 1;
// the diagonal sub-chunks are computed element-wise. Exponents below -87 give exactly 0.
#include <cstdint>

namespace loom::cpu {

// A token-major input: element (b, t, head, i) at p[(b*T + t)*ld + head*D + i]; ld 0 means
// contiguous (heads*D), anything else must be >= heads*D (a view into a fused buffer).
struct GlaIn {
  const float* p = nullptr;
  int64_t ld = 0;
};
struct GlaOut {
  float* p = nullptr;
  int64_t ld = 0;
};

struct GlaCore {
  int64_t B = 0, T = 0, H = 0, Hkv = 0, K = 0, V = 0;
  float scale = 0;  // usually K^-1/2
  // Tokens per chunk (the parallel unit of the intra-chunk work) and per sub-chunk (the block
  // whose decays are computed element-wise). Any sizes give the same result up to rounding.
  int64_t chunk = 64, sub_chunk = 16;
  GlaIn q;                    // [B*T, H*K]
  GlaIn k;                    // [B*T, Hkv*K]
  GlaIn v;                    // [B*T, Hkv*V]
  GlaIn gk;                   // [B*T, Hkv*K], log-decay, <= 0
  const float* h0 = nullptr;  // [B, H, K, V] initial state, or null for zero
};

// o [B*T, H*V] written; ht [B, H, K, V] (the final state) written unless null.
// The checks of the GLA core's arguments (sizes, heads, chunking, row strides), every backend's:
// a loom::Error naming `what` and the argument.
void check_gla_args(const char* what, const GlaCore& a);
void gla_forward(const GlaCore& a, GlaOut o, float* ht);

// Gradients of L(o, ht) given dout = dL/do and dht = dL/dht (null: zero). dq, dk, dv and dgk
// (layouts of q, k, v, gk) are overwritten, dh0 [B, H, K, V] too unless null. The chunk states
// are recomputed, not saved. Deterministic for any thread count: every output element is computed
// by one thread in a fixed order (the G query heads of a kv head are summed in head order).
struct GlaCoreGrads {
  GlaOut dq, dk, dv, dgk;
  float* dh0 = nullptr;
};
void gla_backward(const GlaCore& a, GlaIn dout, const float* dht, const GlaCoreGrads& g);

// The pieces of context parallelism by state passing (parallel/layers/gla_state_passing.hpp).
// decay [B, Hkv, K] = the sum over the T tokens of gk [B*T, Hkv*K] (a segment's total log-decay).
void gla_decay_total(int64_t B, int64_t T, int64_t Hkv, int64_t K, const float* gk, float* decay);
// S [B, H, K, V] <- Diag(e^decay) S + E per (sample, query head), decay of the head's kv head.
void gla_state_fold(int64_t B, int64_t H, int64_t Hkv, int64_t K, int64_t V, const float* decay,
                    const float* E, float* S);

}  // namespace loom::cpu
