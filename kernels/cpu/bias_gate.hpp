#pragma once
// Biases and gates of Qwen2-MoE (ops/ops.hpp "biases and gates"): the attention's q/k/v biases
// added to (a column slice of) a GEMM's output and their gradient, and the shared expert's
// sigmoid gate. Plain scalar C++ (memory-bound, no per-tier code), threaded with OpenMP. Every
// output element is computed by one thread in a fixed order, so the bits are the same whatever
// the thread count. Sizes are checked up front (a loom::Error naming the kernel).
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

// y [M, N] (row stride ldy >= N) += b [N] on every row.
void add_bias(float* y, int64_t M, int64_t N, int64_t ldy, const float* b);
// db [N] += the column sums of dy [M, N] (row stride lddy >= N): each column summed in double in
// row order, then added to db once and rounded to f32.
void bias_grad(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db);

// The logistic function in f32, without overflow for large |z|:
// z >= 0 ? 1 / (1 + e^-z) : e^z / (1 + e^z).
float sigmoid(float z);

// Qwen2-MoE's shared expert gate: y [M, d] row t += s_t * ys[t] with s_t = sigmoid(z[t]),
// z [M] (the gate's logit per token), each element the f32 product rounded, then added; ys f32
// or bf16 (widened exactly). y, ys contiguous.
void sigmoid_gate_forward(const float* z, const float* ys, int64_t M, int64_t d, float* y);
void sigmoid_gate_forward(const float* z, const bf16* ys, int64_t M, int64_t d, float* y);
// Its backward: dys [M, d] row t = s_t * dy[t] (f32, or rounded to bf16); dz [M] overwritten:
// dz[t] = (dy[t] . ys[t]) * s_t (1 - s_t), the dot summed in double over d in column order and
// s (1 - s) = e^-|z| / (1 + e^-|z|)^2 in double (no cancellation for large |z|), the product
// rounded once to f32.
void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           float* dys, float* dz);
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           float* dys, float* dz);
void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz);
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz);

}  // namespace loom::cpu
