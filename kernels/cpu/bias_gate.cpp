#include "kernels/cpu/bias_gate.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

// Plain C++ compiled for the baseline ISA: one pass over the rows each, the memory traffic
// dominates. OpenMP splits rows (or, for the bias gradient, blocks of columns) among threads;
// each output element is computed by one thread in a fixed order, so the bits never depend on the
// thread count.

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMin = int64_t{1} << 14;
// The bias gradient's unit of work: a block of columns summed over every row (64 floats, four
// cache lines of each row).
constexpr int64_t kColBlock = 64;

// Validates up front: an exception must not leave an OpenMP region.
void check_matrix(const char* what, int64_t M, int64_t N, int64_t ld) {
  LOOM_CHECK(M >= 0, what, ": row count M must be >= 0, got ", M);
  LOOM_CHECK(N > 0, what, ": row width must be > 0, got ", N);
  LOOM_CHECK(ld >= N, what, ": row stride ", ld, " is below the row width ", N);
}

// s (1 - s) for s = sigmoid(z), in double: e / (1 + e)^2 with e = e^-|z| (symmetric in z), never
// 1 - s rounded to 0 for large z.
inline double sigmoid_slope(float z) {
  const double e = std::exp(-std::abs(double(z)));
  return e / ((1.0 + e) * (1.0 + e));
}

template <class Y>
void gate_forward_t(const float* z, const Y* ys, int64_t M, int64_t d, float* y) {
  check_matrix("sigmoid_gate_forward", M, d, d);
#pragma omp parallel for schedule(static) if (M * d >= kParallelMin)
  for (int64_t t = 0; t < M; ++t) {
    const float s = sigmoid(z[t]);
    const Y* __restrict r = ys + t * d;
    float* __restrict out = y + t * d;
    for (int64_t c = 0; c < d; ++c) out[c] += s * load_f32(r[c]);
  }
}

template <class Y, class D>
void gate_backward_t(const float* dy, const float* z, const Y* ys, int64_t M, int64_t d, D* dys,
                     float* dz) {
  check_matrix("sigmoid_gate_backward", M, d, d);
#pragma omp parallel for schedule(static) if (M * d >= kParallelMin)
  for (int64_t t = 0; t < M; ++t) {
    const float s = sigmoid(z[t]);
    const float* __restrict g = dy + t * d;
    const Y* __restrict r = ys + t * d;
    D* __restrict out = dys + t * d;
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) {
      dot += double(g[c]) * double(load_f32(r[c]));
      store_f32(out[c], s * g[c]);
    }
    dz[t] = float(dot * sigmoid_slope(z[t]));
  }
}

}  // namespace

float sigmoid(float z) {
  if (z >= 0.0f) return 1.0f / (1.0f + std::exp(-z));
  const float e = std::exp(z);
  return e / (1.0f + e);
}

void add_bias(float* y, int64_t M, int64_t N, int64_t ldy, const float* b) {
  check_matrix("add_bias", M, N, ldy);
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
  for (int64_t m = 0; m < M; ++m) {
    float* __restrict r = y + m * ldy;
    for (int64_t c = 0; c < N; ++c) r[c] += b[c];
  }
}

void bias_grad(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db) {
  check_matrix("bias_grad", M, N, lddy);
  if (M == 0) return;  // nothing to add (db + 0 would turn a -0 into +0)
  const int64_t blocks = (N + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (M * N >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColBlock, w = std::min(kColBlock, N - c0);
    double acc[kColBlock] = {};
    for (int64_t m = 0; m < M; ++m) {
      const float* __restrict r = dy + m * lddy + c0;
      for (int64_t j = 0; j < w; ++j) acc[j] += double(r[j]);
    }
    for (int64_t j = 0; j < w; ++j) db[c0 + j] = float(double(db[c0 + j]) + acc[j]);
  }
}

void sigmoid_gate_forward(const float* z, const float* ys, int64_t M, int64_t d, float* y) {
  gate_forward_t(z, ys, M, d, y);
}
void sigmoid_gate_forward(const float* z, const bf16* ys, int64_t M, int64_t d, float* y) {
  gate_forward_t(z, ys, M, d, y);
}

void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           float* dys, float* dz) {
  gate_backward_t(dy, z, ys, M, d, dys, dz);
}
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           float* dys, float* dz) {
  gate_backward_t(dy, z, ys, M, d, dys, dz);
}
void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz) {
  gate_backward_t(dy, z, ys, M, d, dys, dz);
}
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz) {
  gate_backward_t(dy, z, ys, M, d, dys, dz);
}

}  // namespace loom::cpu
