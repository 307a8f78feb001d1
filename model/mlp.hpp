#pragma once
// The SwiGLU MLP branch of a pre-norm block, shared by every family's block (Llama's, GLA's):
// out = h + down(silu(gate(xn)) * up(xn)), xn = rmsnorm(h). gate and up are one fused
// column-parallel GEMM, down is row-parallel (tensor parallelism; with sequence parallelism h and
// out hold this tp rank's rows). Forward beside backward; what the backward reads is saved in the
// block's MlpActs; where the branch rounds to the compute dtype is its model's BranchPrecision.
#include <cstddef>
#include <cstdint>

#include "core/tensor.hpp"
#include "model/norm_input.hpp"
#include "model/param_unit.hpp"
#include "parallel/layers/activation_checkpoint.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

// What the branch's backward reads.
struct MlpActs {
  Tensor h;     // the branch's input, the residual stream after attention [Mx, d]
  Tensor rstd;  // the norm's [Mx]
  Tensor xn;    // the norm output, as the GEMM reads it (gathered under SP unless not kept)
  Tensor gu;    // gate and up projections [M, 2F]
  Tensor act;   // silu(gate) * up, as the GEMM reads it [M, F]
  size_t bytes() const;
};

// The branch as a block runs it on one micro-batch: its parameters' indices in the block's unit
// and this tp rank's sizes.
struct Mlp {
  const TpRuntime& tp;
  size_t norm, gate, down;  // gate: the first of the fused gate/up matrix (up follows it)
  BranchPrecision precision;
  int64_t M, Mx, d, F;  // rows (Mx: of h, M / tp under SP), hidden size, this rank's ffn size
  float eps;
  DType compute;
  // Whether a norm output saved by a forward that keeps everything holds every row under SP
  // (else the backward gathers it again: recompute_allgather).
  bool keep_gathered;

  // a.h [Mx, d] -> h + the branch [Mx, d] (a new tensor); saves into `a`. `mode` says what to
  // keep: `op` drops xn and act after their GEMMs, and neither `op` nor `full` keeps a gathered
  // GEMM input (it goes to the pooled buffer). Without `output` the down projection is skipped
  // (a `full` block's recomputation needs everything but the output) and an empty tensor
  // returned.
  Tensor forward(const ParamUnit& unit, MlpActs& a,
                 ActivationCheckpoint::Mode mode = ActivationCheckpoint::Mode::none,
                 bool output = true) const;
  // dy: the gradient w.r.t. the branch's output, to which the gradient through the branch is
  // added in place (the residual's passes straight through); parameter gradients accumulate.
  // Recomputes what forward dropped, then frees `a`.
  void backward(ParamUnit& unit, Tensor& dy, MlpActs& a) const;

 private:
  // silu(gate) * up of gu, as the down projection reads it.
  Tensor swiglu(const Tensor& gu) const;
};

}  // namespace loom
