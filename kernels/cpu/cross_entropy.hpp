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
  float grad_scale = 1;    // d(loss)/d(sum of per-token losses), e.g. 1 / number of targets
  float* dx = nullptr;     // [N, D] f32, overwritten (nullptr: not computed)
  float* dw = nullptr;     // [V, D] f32, accumulated (nullptr: not computed)
  int64_t chunk_rows = 0;  // 0: chosen so a chunk's logits stay ~16 MiB
};

// The rows of one chunk (its f32 logits, and with bf16 their bf16 gradient, are the call's
// scratch from the caching allocator): what a meta run books for it.
int64_t linear_cross_entropy_chunk(int64_t N, int64_t V, int64_t chunk_rows);
// Returns the sum over non-ignored rows of -log softmax(x w^T)[target]. Throws loom::Error naming
// the row if a target is >= V.
double linear_cross_entropy(const LinearCrossEntropyArgs& a);

}  // namespace loom::cpu
