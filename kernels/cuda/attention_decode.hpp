#pragma once
// Attention of a few new query positions against a KV cache on the device, for generation: the
// counterpart of kernels/cpu/attention_decode.hpp, with its shape (cpu::DecodeShape), layouts and
// masking (query i of Tq sees keys [0, L - Tq + i]; head h reads kv head h / (Hq / Hkv)). Pointers
// are device memory; the work is queued on the compute stream (kernels/cuda/runtime.hpp) and
// nothing waits for it.
//
// One block of 128 threads per (query, head), no scratch: the keys in chunks of kChunk, each
// chunk's scores (one warp per key, lanes over the head dim, a fixed butterfly) in shared memory,
// an online softmax in base 2 over the chunks (running max and sum, as the CPU kernel's), and each
// thread holding its dims' output accumulators. Deterministic (the same order every call); the
// result differs from the CPU's in the last bits (summation order, exp2f). Decoding is
// bandwidth-bound: every key and value row of the visible cache is read once per query and head
// group.
#include <cstdint>

#include "kernels/cpu/attention_decode.hpp"  // DecodeShape: a plain struct, no backend

namespace loom::cuda {

using cpu::DecodeShape;

// The largest head dim the kernel takes (its per-thread accumulators).
inline constexpr int64_t kDecodeMaxHeadDim = 512;

// q [Tq, q_stride], k/v [L, kv_stride], out [Tq, Hq*D] overwritten (cpu::attention_decode).
void attention_decode(const DecodeShape& s, const float* q, const float* k, const float* v,
                      float* out);

}  // namespace loom::cuda
