#pragma once
// Matrix multiply through oneDNN. Row-major. C[M,N] = op(A)[M,K] * op(B)[K,N] (+ C if accumulate).
// A and B are both f32 or both bf16 (then the products accumulate in f32; on CPUs with AMX or
// AVX512-BF16 oneDNN uses them). C is always f32.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

enum class Trans : bool { N = false, T = true };

struct GemmArgs {
  Trans ta = Trans::N, tb = Trans::N;
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;  // leading dimension of A as stored (row stride)
  const void* B = nullptr;
  int64_t ldb = 0;
  float* C = nullptr;
  int64_t ldc = 0;
  DType ab = DType::f32;
  bool accumulate = false;
};

void gemm(const GemmArgs& a);

// The common linear-layer forms (W stored [out, in] as in Hugging Face):
//   y[M,N] (+)= x[M,K] * W[N,K]^T        linear_forward
//   dx[M,K] (+)= dy[M,N] * W[N,K]        linear_backward_input
//   dW[N,K] += dy[M,N]^T * x[M,K]        linear_backward_weight (always accumulates)
void linear_forward(const void* x, const void* w, float* y, int64_t M, int64_t N, int64_t K,
                    DType ab, bool accumulate = false);
void linear_backward_input(const void* dy, const void* w, float* dx, int64_t M, int64_t N,
                           int64_t K, DType ab, bool accumulate);
void linear_backward_weight(const void* dy, const void* x, float* dw, int64_t M, int64_t N,
                            int64_t K, DType ab);

// Measures this machine's GEMM throughput (FLOP/s) for the dtype on square-ish transformer shapes;
// the denominator of MFU in `loom bench`.
double measure_gemm_peak(DType ab, double seconds = 0.5);

}  // namespace loom::cpu
