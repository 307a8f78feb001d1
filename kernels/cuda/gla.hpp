#pragma once
// The GLA core (gated linear attention) on the device: the counterparts of kernels/cpu/gla.hpp,
// with the same argument structs (cpu::GlaCore, GlaCoreGrads, GlaIn, GlaOut: plain structs whose
// pointers are device memory here), layouts, strides, outputs and GQA head mapping (query head h
// reads kv head h / (H / Hkv); dk, dv, dgk of a kv head sum its query heads). The work is queued on
// the compute stream (kernels/cuda/runtime.hpp) and nothing waits for it.
//
// The first, exact and simple version, fp32 throughout as the CPU (every product on CUDA cores):
//   1. b = the chunk-local inclusive cumsum of gk, in double (as the CPU: under strong decay |b|
//      reaches 1e4 in a chunk, where an f32 ulp would be the error of every decay between nearby
//      tokens); one thread per (sample, chunk, kv column), in token order: the CPU's bits.
//   2. A[r, j] = scale * sum_d q_r[d] k_j[d] e^(b_r[d] - b_j[d]) (j <= r) per (sample, query head,
//      chunk), 32 x 32 tiles of the chunk's lower triangle; every decay element-wise from the
//      double b (never e^b e^-b).
//   3. The forward sweep: one block per (sample, query head, 32 columns of V) walks the chunks in
//      order with the state S [K, 32] in shared memory:
//        o_r = (scale q_r e^b_r) S + sum_{j<=r} A[r, j] v_j,
//        S <- Diag(e^b_last) S + sum_j (k_j e^(b_last - b_j)) v_j^T.
//   The backward recomputes b and A, dA = dO V^T, and the states: the forward sweep stores S_[n]
//   before every chunk n (and S_[NT]), a reverse sweep stores dS_[n+1] = dL/dS after chunk n
//   (dS <- Diag(e^b_last) dS + scale sum_r (q_r e^b_r) dO_r^T, from dht; its last value is dh0).
//   Then the chunks are independent (spec GLA.md 5.4), one block per (chunk, 32 columns):
//     dv_j  = sum_h [ sum_{r>=j} A_h[r, j] dO_h,r + (k_j e^(b_last - b_j)) dS_h ]
//     dq_r  = scale e^b_r (S_n dO_r) + scale sum_{j<=r} dA[r, j] k_j e^(b_r - b_j)
//     dk_j  = sum_h [ e^(b_last - b_j) (dS_h v_j)
//                     + scale sum_{r>=j} dA_h[r, j] q_h,r e^(b_r - b_j) ]
//     dgk_t = sum_{r>=t in the chunk} (sum_h q_h,r dq_h,r - k_r dk_r)
//             + sum_h rowsum(S_h,[n+1] dS_h)
//   (the G query heads of a kv head in head order inside one thread: no atomics).
// Every output element is computed by one thread in a fixed order (the rowsums of dgk by one
// warp's butterfly), so the results have the same bits on every run and every GPU. They differ
// from the CPU's in the last bits: the CPU factors the decay of sub-chunk pairs through a
// reference row (sub_chunk) and sums its dot products in SIMD order, the GPU takes every decay
// element-wise (sub_chunk is checked, as on the CPU, and otherwise unused: any sizes give the
// same result up to rounding) and CUDA's expf is within 2 ulp where the CPU's exp is within 1.
// Decay exponents below -87 give exactly 0 (the CPU's dexp).
//
// Scratch per call (Tensor::empty on the device, released on return: the stream orders reuse):
// b (B*T*Hkv*K doubles); A (and in the backward dA), B*H*T*chunk floats each; in the backward the
// states and state gradients, B*H*(2*NT+1)*K*V floats (NT = ceil(T / chunk)): fla's chunk_gla
// materializes the same. The sweep blocks keep S [K, 32] in shared memory, so K is bounded by the
// GPU's shared memory per block: (48 K + 2112) * 4 bytes, K <= 1166 with an H100's 227 KiB (a
// clear error names it).
//
// A faster version would do what fla's kernels do: the chunk-level products (Q~ S, A V, K~^T V,
// dO V^T, S dO ...) as tensor-core MMAs over [chunk, K] x [K, V] tiles (TF32 or bf16 operands with
// f32 accumulation), the intra-chunk A with the sub-chunk factorization (one GEMM per off-diagonal
// sub-chunk pair, b kept in log2 units for exp2), the chunk states computed in parallel over V
// blocks and stored in bf16, and the dq/dk/dv/dgk passes fused into one kernel per chunk.
#include <cstdint>

#include "kernels/cpu/gla.hpp"  // GlaCore, GlaCoreGrads, GlaIn, GlaOut: plain structs, no backend

namespace loom::cuda {

using cpu::GlaCore;
using cpu::GlaCoreGrads;
using cpu::GlaIn;
using cpu::GlaOut;

// o [B*T, H*V] (row stride o.ld, 0: contiguous) written; ht [B, H, K, V] (the final state)
// written unless null. a.h0 null: a zero initial state.
void gla_forward(const GlaCore& a, GlaOut o, float* ht);

// dq, dk, dv, dgk (layouts and strides of their GlaOut) OVERWRITTEN, dh0 [B, H, K, V] too unless
// null, from dout (dL/do) and dht (dL/dht, null: zero). No output may alias an input.
void gla_backward(const GlaCore& a, GlaIn dout, const float* dht, const GlaCoreGrads& g);

// decay [B, Hkv, K] = the sum over the T tokens of gk [B*T, Hkv*K] (contiguous), in token order
// (one thread per output: the CPU's bits).
void gla_decay_total(int64_t B, int64_t T, int64_t Hkv, int64_t K, const float* gk, float* decay);
// S [B, H, K, V] <- Diag(e^decay) S + E per (sample, query head), decay [B, Hkv, K] of the head's
// kv head (e^x exactly 0 below x = -87).
void gla_state_fold(int64_t B, int64_t H, int64_t Hkv, int64_t K, int64_t V, const float* decay,
                    const float* E, float* S);

}  // namespace loom::cuda
