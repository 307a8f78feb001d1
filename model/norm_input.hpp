#pragma once
// What a pre-norm block's column-parallel GEMMs read: a norm's output, rounded to the compute
// dtype where the model's precision says, and gathered over tp under sequence parallelism. Shared
// by the blocks of every family (model/llama_block.hpp, model/gla_block.hpp, model/mlp.hpp).
#include "core/tensor.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

// Where a block rounds what its GEMMs read to the compute dtype. In f32 both are the same bits;
// in bf16 they are two numerics, each the one its model's reference computes.
enum class BranchPrecision {
  // The norms, GEMMs and SwiGLU write their outputs in the compute dtype themselves: no f32 copy
  // (Llama).
  rounded_outputs,
  // They write f32, and rounded copies are made for the GEMMs that read them (GLA: fla's blocks
  // keep the f32 gate/up projections and SwiGLU output).
  f32_outputs,
};

// The dtype a branch's norm, gate/up GEMM and SwiGLU write.
inline DType output_dtype(BranchPrecision p, DType compute) {
  return p == BranchPrecision::rounded_outputs ? compute : DType::f32;
}

// x as a GEMM of `compute` reads it: x itself when it is in that dtype already, else a rounded
// copy.
inline Tensor in_compute(const Tensor& x, DType compute) {
  return x.dtype() == compute ? x : ops::to_compute(x, compute);
}

// In backward, the input of a column-parallel GEMM that reads rmsnorm(in) (weight, eps): `saved`
// when forward kept it (gathered again under SP unless `saved_gathered`), else recomputed from
// the norm's input (the same kernel on the same input: the same bits), rounded as `precision`
// says, and gathered under SP.
Tensor norm_gemm_input(const TpRuntime& tp, BranchPrecision precision, DType compute,
                       const Tensor& saved, bool saved_gathered, const Tensor& in,
                       const Tensor& weight, float eps);

}  // namespace loom
