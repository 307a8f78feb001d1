#pragma once
// Flash attention on bf16 inputs (the bf16 mixed-precision path of the model): q, k, v (and in the
// backward the attention output) are bf16, every product runs on bf16 operands with f32
// accumulation, as flash attention does on GPUs:
//   S = Q K^T, O += P V, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K,
// with the online softmax, exp, lse and Di in f32, P and dS rounded to bf16 as operands of their
// products, and dO rounded to bf16 once (for its products and for Di = rowsum(dO * O)). Outputs
// (out, lse, dq, dk, dv) are f32.
//
// On CPUs with AVX512_BF16 (at the avx512 tier) the products are vdpbf16ps; on every other CPU and
// tier the same kernels run with the instruction emulated by two f32 FMAs on the widened halves
// (the products of two bf16 are exact in f32), so the semantics are the same everywhere and
// results differ across tiers only in summation order (and vdpbf16ps's flushing of denormals).
// Within a tier results do not depend on the number of threads.
//
// Tiles are those of the f32 kernels (64 queries x 64 keys); the operands are packed once per
// tile into the layout vdpbf16ps wants: for a reduction over an index k, (k, k+1) pairs adjacent
// in one 32-bit word (kernels/cpu/attention_bf16.cpp).
#include <cstdint>
#include <functional>

#include "core/dtype.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_block.hpp"

namespace loom::cpu {

// Layouts and shapes as in attention.hpp / attention_block.hpp; strides count bf16 elements.
void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            float* out, float* lse);
// The same with the output rounded to bf16 as it is written (the bits of the f32 output cast).
void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            bf16* out, float* lse);

// out is the forward's output rounded to bf16 (what the model saves); dq, dk, dv are overwritten.
void attention_backward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                             const bf16* out, const float* lse, const float* dout, float* dq,
                             float* dk, float* dv);

// The block kernels (global positions, attention_block.hpp) on bf16 inputs.
void attention_block_forward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                  const int64_t* q_pos, const int64_t* k_pos, float* out,
                                  float* lse, const std::function<void()>& progress = {});
void attention_block_backward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                   const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                                   const float* delta, const float* dout, float* dq, float* dk,
                                   float* dv, const std::function<void()>& progress = {});

// delta[b, h, t] = sum_d bf16(dout[b,t,h,d]) * out[b,t,h,d] (Di of the bf16 backward).
void attention_delta_bf16(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const bf16* out,
                          const float* dout, float* delta);

// Whether the bf16 kernels run vdpbf16ps now: the avx512 tier is in use, the CPU has AVX512_BF16
// and the tests have not turned it off (set_avx512_bf16_native_allowed, cpu_isa.hpp).
bool attention_bf16_native();

}  // namespace loom::cpu
