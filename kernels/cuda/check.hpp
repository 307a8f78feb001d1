#pragma once
// Every CUDA call and every kernel launch of the backend is checked, and a failure names the op
// (kernels/cuda/*; not for code outside the backend, which includes runtime.hpp only).
#include <cuda_runtime.h>

namespace loom::cuda {

// Throws loom::Error "<op>: <call> failed: <CUDA's name and text>" unless `e` is cudaSuccess.
void check(cudaError_t e, const char* op, const char* call);
// After a launch: a bad configuration or an earlier asynchronous fault, named with `op`.
void check_launch(const char* op);

// Blocks of `threads` that cover `n` items (at least one block).
inline unsigned blocks_for(long long n, int threads) {
  const long long b = (n + threads - 1) / threads;
  return b < 1 ? 1u : static_cast<unsigned>(b);
}

}  // namespace loom::cuda

#define LOOM_CUDA_CHECK(call, op) ::loom::cuda::check((call), (op), #call)
