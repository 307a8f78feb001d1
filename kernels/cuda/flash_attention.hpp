#pragma once
// The fused flash attention kernels of the CUDA backend (FlashAttention-2's scheme, own kernels on
// mma.sync; flash_attention_kernels.cuh has the bodies and the scheme): causal grouped-query
// attention on bf16 operands with the shapes, layouts, strides, masking, outputs and bf16 rounding
// points of attention.hpp's bf16 entry points, which call these when flash_attention_usable holds
// (attention.cu). O(T) memory: no score matrix is materialized.
//
// Differences from the exact path, all within rounding: P is rounded to bf16 against the running
// max of the key tiles seen so far (the CPU kernels' rounding, not the exact path's final max);
// the sums run in the tensor cores' order. Deterministic: no atomics, a fixed order per element
// (dK, dV of a kv head sum its query heads in head order inside one block).
//
// Pointers are device memory; the work is queued on the compute stream and nothing waits.
#include <cstdint>
#include <string>

#include "core/dtype.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_block.hpp"

namespace loom::cuda {

// The block sizes the kernels run with and why: a block owns 16 rows a warp (query rows in the
// forward and dQ, keys in dK/dV); 8 warps at head dim 128 and 4 at 64 by default, one size for
// both with LOOM_FLASH_WARPS=4 or 8 (an unknown value is an error naming it), for the benchmark
// to compare on a GPU.
std::string flash_attention_blocks();
// The head dims the kernels are built for (64 and 128).
bool flash_attention_supported(int64_t D);
// Whether a call can take the flash kernels: a supported D, strides multiples of 8 elements and
// q, k, v 16-byte aligned (the 16-byte copies).
bool flash_attention_usable(int64_t D, int64_t q_stride, int64_t kv_stride, const void* q,
                            const void* k, const void* v);

// The forward of a block (q_pos, k_pos DEVICE int64 arrays, or both null for plain causal
// attention with positions 0..T-1, Tq = Tk): out [B*Tq, Hq*D] f32 or bf16 (exactly one non-null),
// lse [B, Hq, Tq] natural log; a row that sees no key gets out = 0 and lse = -inf. The shape is
// checked by the caller (attention.cu).
void flash_attention_forward_bf16(const cpu::BlockShape& s, const bf16* q, const bf16* k,
                                  const bf16* v, const int64_t* q_pos, const int64_t* k_pos,
                                  float* out_f32, bf16* out_bf16, float* lse);

// The backward of a block pair from the final lse and delta of the query rows: dq, dk, dv (f32,
// layouts of q, k, v) ADDED to when s.accumulate, else overwritten (keys no query sees get 0).
// dout (f32 [B*Tq, Hq*D]) is rounded to bf16 once, in scratch.
void flash_attention_backward_bf16(const cpu::BlockShape& s, const bf16* q, const bf16* k,
                                   const bf16* v, const int64_t* q_pos, const int64_t* k_pos,
                                   const float* lse, const float* delta, const float* dout,
                                   float* dq, float* dk, float* dv);

}  // namespace loom::cuda
