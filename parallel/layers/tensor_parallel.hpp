#pragma once
// Tensor parallelism as layers (docs/design.md decision 5; docs/decisions/tensor-parallel.md), for
// any model: column- and row-parallel linear layers with sequence parallelism (SP), the
// vocabulary-parallel embedding and loss, and the norm gradient summed over ranks. Each forward
// sits beside its backward. With tp off (no group) every layer is the plain single-rank one.
//
// Column parallel: y = x W^T with W split by rows (output features); with SP the input x holds
// this rank's rows of the sequence and is all-gathered first. Row parallel: y = x W^T with W
// split by columns; the partial outputs are summed over tp (all-reduce, or with SP a
// reduce-scatter to this rank's rows).
#include <cstdint>

#include "core/tensor.hpp"
#include "distributed/buffer_pool.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace dist {
class ProcessGroup;
}

struct TpOptions {
  dist::ProcessGroup* group = nullptr;  // the mesh's "tp" group; nullptr: none
  bool sequence_parallel = true;        // shard the B*T rows outside attention and the MLP
  bool recompute_allgather = false;     // all-gather a GEMM input again in backward
  // "Async TP": with SP, the forward all-gather before q/k/v and gate/up runs while the GEMM of
  // this rank's own rows (which need no gather) is computed in chunks, driving MPI between them.
  bool async = false;
  int size() const;
  int rank() const;
};

// What the layers need at run time: the options and the pool of communication buffers.
struct TpRuntime {
  TpOptions opt;
  dist::BufferPool* pool = nullptr;
  bool on() const { return opt.size() > 1; }
  bool sp() const { return on() && opt.sequence_parallel; }
};

// A communication buffer of the pool (contents undefined; see BufferPool for the key contract).
Tensor tp_pooled(const TpRuntime& tp, dist::BufferPurpose purpose, const Shape& shape, DType dt,
                 Device dev);
// Collectives over the tp group; a meta tensor moves nothing.
void tp_all_reduce(const TpRuntime& tp, Tensor& t);
// The rows of every tp rank, in rank order: [n rows, cols] -> out [tp n rows, cols].
void tp_gather_rows(const TpRuntime& tp, const Tensor& in, Tensor& out);
// This rank's rows of the sum over tp ranks: [tp n rows, cols] -> out [n rows, cols].
void tp_reduce_scatter_rows(const TpRuntime& tp, const Tensor& in, Tensor& out);
// A partial result [M, cols] of every tp rank summed over tp: all-reduced in place, or with SP
// reduce-scattered to this rank's rows (a pooled buffer). Returns the sum.
Tensor tp_sum_partial(const TpRuntime& tp, Tensor& part);
// With SP: every row of a GEMM input, gathered into a pooled buffer.
Tensor tp_gather_input(const TpRuntime& tp, const Tensor& local);

// Column-parallel forward, y [M, N] = input w^T, `local` in the compute dtype (this rank's rows
// with SP). `saved` receives what backward reads as the GEMM input: the gathered input (a new
// tensor) when `keep_gathered`, else `local` (backward gathers again; the gather goes to a pooled
// buffer). Async TP overlaps the gather with the GEMM of the local rows.
void column_parallel_forward(const TpRuntime& tp, const Tensor& local, const Tensor& w,
                             bool keep_gathered, Tensor& saved, Tensor& y);
// Column-parallel backward: dW += dout^T in, returns dx = dout w summed over tp (this rank's rows
// with SP). `in` holds every row (the caller gathers it again when forward kept only its own).
Tensor column_parallel_backward(const TpRuntime& tp, const Tensor& dout, const Tensor& in,
                                const Tensor& w, const ops::WeightGrad& dw);

// Row-parallel forward: returns residual + (in w^T summed over tp), [rows of residual, cols];
// `in` [M, K] in the compute dtype, M every row.
Tensor row_parallel_forward(const TpRuntime& tp, const Tensor& in, const Tensor& w,
                            const Tensor& residual);
// Row-parallel backward: dy is the gradient w.r.t. the output (this rank's rows with SP, f32);
// dW += dy^T in (every row), din = dy w written.
void row_parallel_backward(const TpRuntime& tp, const Tensor& dy, const Tensor& in, const Tensor& w,
                           const ops::WeightGrad& dw, Tensor& din, DType compute);

// A replicated parameter's gradient of which each tp rank computes a part, with or without SP (a
// head norm's share of this rank's heads, a router's share of this rank's experts): fn(part)
// writes the rank's part into a zeroed buffer, whose sum over tp is written to dw (added, or
// copied where dw holds nothing yet). Without tp, fn(dw) directly. Under tp the part is needed
// now: a zero-bubble I (ops::DeferWeightGrads) does not defer fn's weight gradient (deferred, it
// would be summed before it is computed, into a pooled buffer reused meanwhile).
template <class Fn>
void tp_summed_weight_grad(const TpRuntime& tp, const ops::WeightGrad& dw, Fn&& fn) {
  if (!tp.on()) {
    fn(dw);
    return;
  }
  Tensor part =
      tp_pooled(tp, dist::BufferPurpose::norm_grad, dw.t.shape(), DType::f32, dw.t.device());
  part.zero_();
  {
    const ops::WeightGradsNow now;
    fn(ops::WeightGrad(part));
  }
  tp_all_reduce(tp, part);
  Tensor grad = dw.t;  // a view of the gradient
  if (dw.take_first_write())
    ops::copy(part, grad);
  else
    ops::add_inplace(grad, part);
}

// A norm's weight gradient when every tp rank normed different rows (SP): `fn(g)` writes the
// rank's part, whose sum over tp is added to `grad` (tp_summed_weight_grad's buffer, so a gradient
// accumulated over micro-batches is not summed twice). Without SP every rank normed every row and
// holds the whole gradient: fn(grad) directly.
template <class Fn>
void tp_summed_norm_grad(const TpRuntime& tp, Tensor& grad, Fn&& fn) {
  if (!tp.sp()) {
    fn(grad);
    return;
  }
  tp_summed_weight_grad(tp, ops::WeightGrad(grad), [&](const ops::WeightGrad& dw) {
    Tensor part = dw.t;
    fn(part);
  });
}

// Rows of a vocabulary-parallel table on each of `tp` ranks: the vocabulary padded to a multiple
// of tp (Megatron's make-vocab-size-divisible-by).
inline int64_t local_vocab(int64_t vocab, int tp) {
  return (vocab + tp - 1) / tp;
}

// Vocabulary-parallel embedding: `table` holds rows [v0, v0 + rows); x [rows of the residual
// stream, d] receives the embedding of `tokens` (M of them), summed over tp (this rank's rows
// with SP).
void vocab_parallel_embedding_forward(const TpRuntime& tp, const Tensor& tokens,
                                      const Tensor& table, int64_t v0, Tensor& x);
// dtable[tokens - v0] += dx (gathered over tp with SP), for this rank's vocabulary rows.
void vocab_parallel_embedding_backward(const TpRuntime& tp, const Tensor& tokens, const Tensor& dx,
                                       int64_t v0, Tensor& dtable);

// The output projection fused with the loss over a vocabulary split across tp ranks ("loss
// parallel"): a.w holds this rank's vocabulary rows [v0, v0 + a.V), of which those below
// `vocab` are real. Writes the summed loss into a.loss (float64 [1] on the device); a.dx gets this
// rank's part of dx (the caller sums it over tp), a.dw this rank's rows exactly. Without tp, the
// single-rank fused loss.
void vocab_parallel_cross_entropy(const TpRuntime& tp, const ops::LinearCrossEntropy& a, int64_t v0,
                                  int64_t vocab);

}  // namespace loom
