#pragma once
// The output projection fused with cross-entropy, forward and backward in one pass over chunks of
// rows: logits exist only for `chunk_rows` rows at a time, never for the whole sequence.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

struct LinearCrossEntropyArgs {
  const void* x = nullptr;  // [N, D] final hidden states (dtype `ab`)
  const void* w = nullptr;  // [V, D] output projection (dtype `ab`)
  DType ab = DType::f32;
  const int32_t* targets = nullptr;  // [N]; a target < 0 is ignored
  int64_t N = 0, D = 0, V = 0;
  float grad_scale = 1;       // d(loss)/d(sum of per-token losses), e.g. 1 / number of targets
  float* dx = nullptr;        // [N, D] f32, overwritten (nullptr: not computed)
  float* dw = nullptr;        // [V, D] f32, accumulated (nullptr: not computed)
  bool dw_overwrite = false;  // dw holds nothing yet: the first dW GEMM writes instead of adding
  int64_t chunk_rows = 0;     // 0: chosen so a chunk's logits stay ~16 MiB
  // bf16 with gradients: rows of bf16 logit gradients gathered (from chunks of `chunk_rows` f32
  // logits) before the dx and dW GEMMs run on them; 0 or anything <= chunk_rows: one chunk's. Each
  // dW GEMM reads and writes all of the f32 dW, so its inner dimension is these rows: at V 8192
  // and D 512, 112 of them make the loss 1.5x slower than 2048 (the head's f32 dW re-read every
  // chunk), while a chunk of f32 logits needs only enough rows for an efficient logits GEMM.
  // Rounded down to a multiple of the (effective) chunk_rows.
  int64_t grad_rows = 0;
};

// The rows of one chunk of f32 logits and of the bf16 logit gradients (the call's scratch from the
// caching allocator, the latter only for bf16 with gradients): what a meta run books for them.
struct LinearCrossEntropyChunks {
  int64_t rows = 0, grad_rows = 0;
};
LinearCrossEntropyChunks linear_cross_entropy_chunks(int64_t N, int64_t V, int64_t chunk_rows,
                                                     int64_t grad_rows);
// The bytes of the head's weight w packed once for the logits GEMMs of all chunks (gemm.hpp
// PackedB; a plain call would reorder it for each chunk), 0 where the kernel does not pack: one
// chunk, a product widened to f32, or a packed copy larger than the chunk's scratch (the f32
// logits and bf16 gradients), so that packing at most doubles the loss's workspace (an 8B model's
// head weight is 1 GiB in bf16, its chunk scratch 160 MiB).
size_t linear_cross_entropy_packed_bytes(int64_t N, int64_t D, int64_t V, DType ab,
                                         const LinearCrossEntropyChunks& ch, bool grad16);
// Returns the sum over non-ignored rows of -log softmax(x w^T)[target]. Throws loom::Error naming
// the row if a target is >= V.
double linear_cross_entropy(const LinearCrossEntropyArgs& a);

}  // namespace loom::cpu
