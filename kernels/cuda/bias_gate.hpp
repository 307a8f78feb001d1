#pragma once
// Qwen2-MoE's biases and shared-expert gate on the device: the counterparts of
// kernels/cpu/bias_gate.hpp, with the same arguments, layouts and results (read that header for
// the contracts). Pointers are device memory; the work is queued on the compute stream
// (kernels/cuda/runtime.hpp) and nothing waits for it.
//
// Numerics: add_bias and the gate's products have the CPU's bits on the CPU's sigmoid (its exp as
// e^x in double rounded to f32: glibc's expf agrees but for rare midpoints); the sums over rows or
// columns are in double in a fixed order set by the shapes alone (no atomics), so the bits are the
// same on every run and within a rounding of the CPU's f32 result.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cuda {

// y [M, N] (row stride ldy >= N) += b [N] on every row.
void add_bias(float* y, int64_t M, int64_t N, int64_t ldy, const float* b);
// db [N] += the column sums of dy [M, N] (row stride lddy >= N), in double: fixed ranges of
// consecutive rows (at most 512, their bounds from M alone), each summed by 8 row lanes (every
// 8th row, in order) and the lanes in order into its own partial (scratch from the caching
// allocator), the partials added in range order, the total added to db once and rounded to f32.
// M == 0 leaves db as it is.
void bias_grad(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db);

// y [M, d] row t += s_t * ys[t] with s_t = sigmoid(z[t]); one block per row.
void sigmoid_gate_forward(const float* z, const float* ys, int64_t M, int64_t d, float* y);
void sigmoid_gate_forward(const float* z, const bf16* ys, int64_t M, int64_t d, float* y);
// dys [M, d] row t = s_t * dy[t] (f32, or rounded to bf16); dz [M] overwritten with
// (dy[t] . ys[t]) * s_t (1 - s_t): one warp per row, the dot in double (a fixed order), the slope
// e^-|z| / (1 + e^-|z|)^2 in double as the CPU's.
void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           float* dys, float* dz);
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           float* dys, float* dz);
void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz);
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz);

}  // namespace loom::cuda
