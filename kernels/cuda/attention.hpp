#pragma once
// Causal grouped-query attention on the device: the counterparts of kernels/cpu/attention.hpp,
// attention_bf16.hpp and attention_block.hpp, with the same shapes (cpu::AttentionShape,
// cpu::BlockShape), layouts, strides, outputs and bf16 rounding points. Pointers are device memory;
// the work is queued on the compute stream (kernels/cuda/runtime.hpp) and nothing waits for it.
//
// The bf16 entry points run the fused flash kernels (flash_attention.hpp) at head dims 64 and 128
// with 16-byte aligned, 8-element strided q, k, v; everything else runs the exact and simple
// version described here (f32 always): per (sample, q head) the
// whole score matrix S [Tq, Tk] is materialized in scratch from the caching allocator (O(Tq*Tk)
// memory, reused by every head: the stream orders them), with cuda::gemm on strided views of q, k,
// v (no copies: lda is the row stride of the fused qkv buffer; q head h reads kv head h /
// (Hq/Hkv)):
//   forward   S = Q K^T, a masked row softmax (P, the row sums, lse), O = P V, out = O / rowsum;
//   backward  S = Q K^T and dP = dO V^T again, P = exp(scale*S - lse), dS = P (dP - delta) scale,
//             dV (+)= P^T dO, dK (+)= dS^T Q, dQ (+)= dS K.
// That is a loop of 2 (forward) or 5 (backward) small GEMM calls per head plus one row kernel per
// head: slow next to a fused kernel, but every product is a plain cuBLASLt GEMM and every step is
// easy to check. All results are deterministic (fixed reduction trees; the GEMMs' algorithms are
// fixed per shape); they differ from the CPU's in the last bits (summation order, exp2f).
//
// Masking: key j is visible to query i iff k_pos[j] <= q_pos[i] (plain attention: positions
// 0..T-1). Masked entries get exactly 0 probability (selected, never computed: no exp of a masked
// score). A row that sees no key gets out = 0 and lse = -inf (the CPU block kernel's convention,
// which attention_merge treats as "no contribution"), and in the backward a row whose lse is -inf
// contributes nothing.
//
// Scores in base 2, as the CPU kernels: m = max_j(S_ij * c), c = scale * log2(e),
// P_ij = exp2f(S_ij * c - m) (unnormalized; the forward divides O by rowsum(P) at the end, as the
// CPU does), lse = (m + log2(rowsum P)) * ln(2).
//
// bf16 variants (q, k, v bf16; the CPU's attention_bf16.hpp): bf16 GEMM operands with f32
// accumulation; P is rounded to bf16 (f32_to_bf16_bits, the CPU's bits) before O = P V, and in the
// backward P and dS * scale are rounded before their GEMMs, dout is rounded to bf16 once (for dP,
// dV and, in the plain backward, delta); softmax, lse, delta and all outputs are f32 (out may be
// bf16: the f32 output rounded as written, bit for bit the f32 variant's output rounded). The
// forward's P is unnormalized against the row's final max, where the CPU's online softmax rounds it
// against the running max of the key tiles seen so far (the same for rows of at most 64 keys): the
// roundings are of the same size, not always of the same values.
//
// Scratch per call (Tensor::empty on the device): S [Tq, Tk'] f32 (Tk' = Tk rounded up to 8), and
// for the bf16 forward P [Tq, Tk'] bf16; the backward dP [Tq, Tk'] f32 too (bf16: P and dS bf16,
// and dout rounded, B*Tq*Hq*D bf16); the row sums (B*Hq*Tq f32); the bf16-output forward an f32
// copy of out. No output may alias an input.
#include <cstdint>

#include "core/dtype.hpp"
#include "kernels/cpu/attention.hpp"        // AttentionShape: a plain struct, no backend
#include "kernels/cpu/attention_block.hpp"  // BlockShape

namespace loom::cuda {

using cpu::AttentionShape;
using cpu::BlockShape;

// Causal attention of a sequence against itself (cpu::attention_forward): q [B*T, q_stride],
// k/v [B*T, kv_stride], out [B*T, Hq*D] and lse [B, Hq, T] written.
void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse);
// dq, dk, dv (layouts and strides of q, k, v) OVERWRITTEN; delta = rowsum(dout * out) is computed
// here (scratch).
void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv);

// bf16 operands (cpu::attention_forward_bf16): out f32, or rounded to bf16 as written.
void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            float* out, float* lse);
void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            bf16* out, float* lse);
// out is the forward's output rounded to bf16; delta = rowsum(bf16(dout) * out);
// dq, dk, dv (f32) OVERWRITTEN.
void attention_backward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                             const bf16* out, const float* lse, const float* dout, float* dq,
                             float* dk, float* dv);

// One block of queries against one block of keys (ring attention, cpu::attention_block_forward):
// q_pos [Tq] and k_pos [Tk] are DEVICE arrays of int64 global positions (the same for every sample;
// any order). out/lse of the queries against this key block alone; a row that sees no key gets
// out = 0 and lse = -inf. No progress callback: nothing here waits on the host.
void attention_block_forward(const BlockShape& s, const float* q, const float* k, const float* v,
                             const int64_t* q_pos, const int64_t* k_pos, float* out, float* lse);
void attention_block_forward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                  const int64_t* q_pos, const int64_t* k_pos, float* out,
                                  float* lse);

// This block pair's dq (layout of q), dk, dv (layout of k, v) from the FINAL lse and delta of the
// query rows ([B, Hq, Tq]): ADDED to dq, dk, dv when s.accumulate (the default), overwritten when
// not (then keys no query sees get 0).
void attention_block_backward(const BlockShape& s, const float* q, const float* k, const float* v,
                              const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                              const float* delta, const float* dout, float* dq, float* dk,
                              float* dv);
// bf16 operands: dout is rounded to bf16 for its products; delta as given.
void attention_block_backward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                   const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                                   const float* delta, const float* dout, float* dq, float* dk,
                                   float* dv);

// Folds (out_b, lse_b) into (out_a, lse_a) in place (cpu::attention_merge): out [B*Tq, Hq*D],
// lse [B, Hq, Tq]; lse = log(e^lse_a + e^lse_b), out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b
// with CUDA's expf/logf; lse_b = -inf leaves the row as it is, lse_a = -inf takes row b.
void attention_merge(int64_t B, int64_t Tq, int64_t Hq, int64_t D, float* out_a, float* lse_a,
                     const float* out_b, const float* lse_b);
// delta[b, h, t] = sum_d dout[b,t,h,d] * out[b,t,h,d] (out, dout [B*Tq, Hq*D]; one warp per row,
// a fixed order).
void attention_delta(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const float* out,
                     const float* dout, float* delta);
// The bf16 backward's: sum_d bf16(dout) * out with out bf16 (cpu::attention_delta_bf16).
void attention_delta_bf16(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const bf16* out,
                          const float* dout, float* delta);

}  // namespace loom::cuda
