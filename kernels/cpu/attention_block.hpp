#pragma once
// Attention of one block of queries against one block of keys, for context parallelism (ring
// attention): each cp rank holds some chunks of every sequence, so queries and keys carry their
// GLOBAL token positions and causality is decided by those (key visible iff k_pos <= q_pos).
// Partial results of several key blocks combine by their log-sum-exp (attention_merge); the
// backward of a block pair needs only the FINAL out and lse of the query rows (flash backward:
// p = exp(s - lse), ds = p * (dp - Di) with Di = rowsum(dO * O)), so ring steps in backward are
// independent and their dq/dk/dv contributions add up.
#include <cstdint>
#include <functional>
#include <vector>

namespace loom::cpu {

// Layouts as in attention.hpp, with separate query and key lengths:
//   q[b, t, h, :]   at q + (b*Tq + t)*q_stride + h*D       (t < Tq, h < Hq)
//   k/v[b, t, g, :] at k + (b*Tk + t)*kv_stride + g*D      (t < Tk, g < Hkv, g = h / (Hq/Hkv))
//   out[b, t, h, :] at out + (b*Tq + t)*Hq*D + h*D
//   lse[b, h, t]    at lse + (b*Hq + h)*Tq + t
// q_pos[Tq], k_pos[Tk]: global positions, the same for every sample of the batch.
struct BlockShape {
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, D = 0;
  int64_t q_stride = 0, kv_stride = 0;
  float scale = 0;
  bool accumulate = true;  // backward: add into dq, dk, dv; false: overwrite them
};

// Number of (query, key) pairs with k_pos <= q_pos: the score entries a block computes (per
// sample and head). Zero means the block is skipped.
int64_t causal_entries(const int64_t* q_pos, int64_t Tq, const int64_t* k_pos, int64_t Tk);

// The query and key tile size of the block kernels below.
constexpr int64_t kAttentionTile = 64;
// Number of (query, key) entries the tiled kernels compute per sample and head: every entry of
// each tile pair that is not skipped (so at least causal_entries). The masked diagonal pairs count
// whole: the vectors they skip past the diagonal are a fraction of one tile per tile row.
int64_t tiled_entries(const int64_t* q_pos, int64_t Tq, const int64_t* k_pos, int64_t Tk);

// Both block kernels are tiled flash kernels (64x64 tiles; plain causal attention in
// attention.hpp is these kernels with positions 0..T-1). Positions are arbitrary (unsorted, a tile
// may straddle two chunks): a tile pair is skipped when its earliest key follows its latest query,
// computed unmasked when its latest key precedes its earliest query, and otherwise masked: past
// the diagonal, skipping whole vectors, when both tiles are runs of consecutive positions; entry
// by entry when not. Results do not depend on the number of threads.
//
// progress, when set, is called once on entry and then between work units (never inside the
// tile loops), only on OpenMP thread 0 of the kernel's team, i.e. the thread that called the
// kernel, never concurrently: a ring step uses it to poll the nonblocking K/V transfer in flight
// (MPI moves data only inside MPI calls; FUNNELED threading).

// out/lse of the queries against this key block alone. A row that sees no key gets out = 0 and
// lse = -inf, which attention_merge treats as "no contribution".
void attention_block_forward(const BlockShape& s, const float* q, const float* k, const float* v,
                             const int64_t* q_pos, const int64_t* k_pos, float* out, float* lse,
                             const std::function<void()>& progress = {});

// Folds a partial result (out_b, lse_b) into the running one (out_a, lse_a), in place:
// lse = log(e^lse_a + e^lse_b), out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b.
void attention_merge(int64_t B, int64_t Tq, int64_t Hq, int64_t D, float* out_a, float* lse_a,
                     const float* out_b, const float* lse_b);

// delta[b, h, t] = sum_d dout[b,t,h,d] * out[b,t,h,d] (Di of the flash backward), once per step.
void attention_delta(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const float* out,
                     const float* dout, float* delta);

// Adds this block pair's contributions to dq (layout of q) and to dk, dv (layout of k, v), given
// the FINAL lse of the query rows and their delta. Accumulates (the caller zeroes once), unless
// s.accumulate is false: then dq, dk, dv are overwritten.
void attention_block_backward(const BlockShape& s, const float* q, const float* k, const float* v,
                              const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                              const float* delta, const float* dout, float* dq, float* dk,
                              float* dv, const std::function<void()>& progress = {});

}  // namespace loom::cpu
