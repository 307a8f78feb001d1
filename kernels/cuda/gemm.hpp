#pragma once
// Matrix multiply through cuBLASLt, with the contract of kernels/cpu/gemm.hpp (GemmArgs):
// row-major C[M,N] = op(A)[M,K] op(B)[K,N] (+ C when accumulate), A and B both f32 or both bf16
// (products accumulated in f32), C f32; or the product rounded to bf16 into C16; or C = R + AB.
// Pointers are device memory; the work is queued on the compute stream.
//
// float32 is exact float32 (CUBLAS_COMPUTE_32F): TF32 only after set_allow_tf32(true)
// (`[training] allow_tf32`). The algorithm is chosen by cuBLASLt's heuristic once per shape,
// transposes, leading dimensions, types and pointer alignments, and cached for the process; every
// call may use a 32 MiB workspace from the device allocator.
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/gemm.hpp"  // GemmArgs, Trans, check_gemm_args: no kernel of the CPU's
#include "kernels/cuda/scratch.hpp"

namespace loom::cuda {

using cpu::GemmArgs;
using cpu::Trans;

void gemm(const GemmArgs& a);

void set_allow_tf32(bool allow);
bool allow_tf32();

// The column-major problem cuBLASLt is given for a row-major GemmArgs (host-side, tested without
// a GPU): C^T [N, M] = op(B)^T op(A)^T, so cuBLASLt's first operand is B's buffer and its second
// is A's. rows/cols are of each matrix as stored, column-major.
struct LtProblem {
  bool trans_a = false, trans_b = false;  // cuBLASLt's transa (on B's buffer) and transb (A's)
  uint64_t a_rows = 0, a_cols = 0;        // B's buffer
  int64_t lda = 0;
  uint64_t b_rows = 0, b_cols = 0;  // A's buffer
  int64_t ldb = 0;
  uint64_t c_rows = 0, c_cols = 0;  // C (and R, D)
  int64_t ldc = 0;
};
LtProblem lt_problem(const GemmArgs& a);
// The largest power of two up to 16 that divides the address (cuBLASLt's alignment preference).
unsigned pointer_alignment(const void* p);

// Bytes of the workspace each GEMM may use: kGemmWorkspaceBytes (kernels/cuda/scratch.hpp).

}  // namespace loom::cuda
