#include "kernels/cpu/swiglu.hpp"

#include <cstdint>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/swiglu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

constexpr int64_t kParallelMin = int64_t{1} << 14;

// Scalar for the tails of rows, on kW lanes for the rest (see vexp(vf)).
inline float sigmoid(float x) {
  return 1.0f / (1.0f + vexp(-x));
}
inline vf sigmoid(vf x) {
  return 1.0f / (1.0f + vexp(-x));
}

// The forward's output is f32, or bf16 for mixed precision (only a bf16 GEMM reads it). bf16 is
// rounded in registers as a GEMM operand (store_bf16_operand): the bits of the f32 result cast
// afterwards, except that vcvtneps2bf16 flushes an f32 denormal to zero where it runs; the f32
// values never go to memory.
inline void put(float* p, vf x, bool) {
  store(p, x);
}
inline void put(bf16* p, vf x, bool native) {
  store_bf16_operand(p, x, native);
}
inline void put(float& dst, float v, bool) {
  dst = v;
}
inline void put(bf16& dst, float v, bool native) {
  dst = to_bf16_operand(v, native);
}
// A bf16 input widens exactly.
using HWY_NAMESPACE::load;
inline vf load(const bf16* p) {
  return load_bf16(p);
}
inline float get(float v) {
  return v;
}
inline float get(bf16 v) {
  return bf16_to_float(v);
}

template <class In, class T>
void swiglu_forward_t(const In* gu, int64_t rows, int64_t F, T* h, bool native = false) {
#pragma omp parallel for schedule(static) if (rows * F >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const In* __restrict g = gu + r * 2 * F;
    const In* __restrict u = g + F;
    T* __restrict hr = h + r * F;
    int64_t j = 0;
    for (; j + kW <= F; j += kW) {
      const vf gj = load(g + j);
      put(hr + j, gj * sigmoid(gj) * load(u + j), native);
    }
    for (; j < F; ++j) {
      const float gj = get(g[j]);
      put(hr[j], gj * sigmoid(gj) * get(u[j]), native);
    }
  }
}

}  // namespace

void swiglu_forward_impl(const float* gu, int64_t rows, int64_t F, float* h) {
  swiglu_forward_t(gu, rows, F, h);
}
void swiglu_forward_bf16_impl(const float* gu, int64_t rows, int64_t F, bf16* h, bool native) {
  swiglu_forward_t(gu, rows, F, h, native);
}
void swiglu_forward_bf16_in_impl(const bf16* gu, int64_t rows, int64_t F, bf16* h, bool native) {
  swiglu_forward_t(gu, rows, F, h, native);
}

// With s = sigmoid(g): d silu(g)/dg = s + g s (1 - s) = s (1 + g (1 - s)). In bf16 the gate and up
// come in as the forward saved them and their gradients go out rounded for the GEMM that reads
// them, in one pass.
template <class T>
void swiglu_backward_t(const float* dh, const T* gu, int64_t rows, int64_t F, T* dgu,
                       bool native = false) {
#pragma omp parallel for schedule(static) if (rows * F >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    // No __restrict here: dgu may be gu itself (the model overwrites the saved gate/up in place).
    // Each element is read into registers before its gradients are stored.
    const T* g = gu + r * 2 * F;
    const T* u = g + F;
    const float* d = dh + r * F;
    T* dg = dgu + r * 2 * F;
    T* du = dg + F;
    int64_t j = 0;
    for (; j + kW <= F; j += kW) {
      const vf gj = load(g + j), uj = load(u + j), dj = load(d + j);
      const vf s = sigmoid(gj);
      put(dg + j, dj * uj * s * (1.0f + gj * (1.0f - s)), native);
      put(du + j, dj * gj * s, native);
    }
    for (; j < F; ++j) {
      const float gj = get(g[j]), uj = get(u[j]), dj = d[j];
      const float s = sigmoid(gj);
      put(dg[j], dj * uj * s * (1.0f + gj * (1.0f - s)), native);
      put(du[j], dj * gj * s, native);
    }
  }
}

void swiglu_backward_impl(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu) {
  swiglu_backward_t(dh, gu, rows, F, dgu);
}
void swiglu_backward_bf16_impl(const float* dh, const bf16* gu, int64_t rows, int64_t F, bf16* dgu,
                               bool native) {
  swiglu_backward_t(dh, gu, rows, F, dgu, native);
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_args(const char* what, int64_t rows, int64_t F) {
  LOOM_CHECK(rows >= 0, what, ": rows must be >= 0, got ", rows);
  LOOM_CHECK(F > 0, what, ": F (hidden size of the MLP) must be > 0, got ", F);
}

}  // namespace

HWY_EXPORT(swiglu_forward_impl);
HWY_EXPORT(swiglu_backward_impl);
HWY_EXPORT(swiglu_forward_bf16_impl);
HWY_EXPORT(swiglu_forward_bf16_in_impl);
HWY_EXPORT(swiglu_backward_bf16_impl);

void swiglu_forward(const float* gu, int64_t rows, int64_t F, float* h) {
  check_args("swiglu_forward", rows, F);
  LOOM_DISPATCH(swiglu_forward_impl)(gu, rows, F, h);
}

void swiglu_backward(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu) {
  check_args("swiglu_backward", rows, F);
  LOOM_DISPATCH(swiglu_backward_impl)(dh, gu, rows, F, dgu);
}

void swiglu_forward(const float* gu, int64_t rows, int64_t F, bf16* h) {
  check_args("swiglu_forward", rows, F);
  LOOM_DISPATCH(swiglu_forward_bf16_impl)(gu, rows, F, h, avx512_bf16_native());
}

void swiglu_forward(const bf16* gu, int64_t rows, int64_t F, bf16* h) {
  check_args("swiglu_forward", rows, F);
  LOOM_DISPATCH(swiglu_forward_bf16_in_impl)(gu, rows, F, h, avx512_bf16_native());
}

void swiglu_backward(const float* dh, const bf16* gu, int64_t rows, int64_t F, bf16* dgu) {
  check_args("swiglu_backward", rows, F);
  LOOM_DISPATCH(swiglu_backward_bf16_impl)(dh, gu, rows, F, dgu, avx512_bf16_native());
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
