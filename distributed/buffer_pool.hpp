#pragma once
// Communication buffers of tensor parallelism (docs/design.md decision 9): one buffer per
// (purpose, dtype, size), allocated on first use and handed out again on every later request,
// so the buffers of a step do not grow with the number of layers and are never allocated per
// call. A buffer is valid until the next request with the same key: purposes name uses that are
// never alive at the same time under the same key (the caller's contract). Buffers that must
// live from forward to backward are not taken from the pool.
#include <cstdint>
#include <map>
#include <tuple>

#include "core/tensor.hpp"

namespace loom::dist {

// What a pooled buffer is for (the first part of its key). "Summed over tp": the buffer holds this
// rank's partial value, which a collective over the tp group sums.
enum class BufferPurpose {
  ag_input,        // a GEMM input's rows of every tp rank, all-gathered (SP: column-parallel
                   // forward without keep_gathered, the vocab-parallel loss's input)
  col_dx,          // a column-parallel input gradient, summed over tp (also the head's [M, d])
  col_dx_rs,       // SP: this rank's rows of that sum (a reduce-scatter of col_dx)
  row_out,         // a row-parallel output or a vocab-parallel embedding, summed over tp
  row_out_rs,      // SP: this rank's rows of that sum (a reduce-scatter of row_out)
  ag_dy,           // SP: an output gradient's rows of every tp rank, all-gathered (the backward
                   // of row-parallel linear and of the vocab-parallel embedding)
  norm_grad,       // a replicated parameter's gradient (a norm's, a router's), summed over tp
  gla_gnorm_grad,  // GLA's gated head norm's weight gradient, summed over tp
  ce_lse_all,      // the vocab-parallel loss: the log-sum-exps of every tp rank [tp, N]
  ce_target,       // the vocab-parallel loss: the target logits [N], summed over tp
  ce_dlogits,      // the vocab-parallel loss: a chunk of logit gradients in bf16 [rows, V/tp]
};

class BufferPool {
 public:
  // A contiguous [numel] tensor of `dtype` for `purpose` (contents undefined).
  Tensor get(BufferPurpose purpose, DType dtype, int64_t numel, Device device = Device::cpu);
  size_t bytes() const;  // every buffer held
  size_t count() const { return buffers_.size(); }

 private:
  std::map<std::tuple<BufferPurpose, DType, int64_t>, Tensor> buffers_;
};

}  // namespace loom::dist
