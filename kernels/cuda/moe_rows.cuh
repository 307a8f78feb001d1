#pragma once
// Device helpers of the mixture-of-experts kernels (moe.cu) and Qwen2-MoE's biases and gate
// (bias_gate.cu): scalar loads and stores of f32 or bf16 rows, the CPU's exp and sigmoid, and the
// warp's "scaled copy of a row plus its dot product in double" that moe_combine_backward and
// sigmoid_gate_backward share.
#include <cstdint>

#include "kernels/cuda/vec.cuh"

namespace loom::cuda {

// An element widened to float (bf16 exactly), and stored (bf16 rounded as the CPU's store_f32).
__device__ __forceinline__ float widen(float v) {
  return v;
}
__device__ __forceinline__ float widen(uint16_t v) {
  return bf16_bits_to_f32(v);
}
__device__ __forceinline__ void put(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void put(uint16_t* p, float v) {
  *p = f32_to_bf16_bits(v);
}

// The CPU kernels' std::exp(float): e^x in double, rounded once to f32. glibc's expf is within
// 0.502 ulp (double arithmetic, rounded once), so the two agree but where e^x lies within a
// double's rounding of an f32 midpoint; CUDA's expf (2 ulp) would differ in the last bit often.
__device__ __forceinline__ float exp_f32(float x) {
  return float(exp(double(x)));
}
// The CPU's cpu::sigmoid (kernels/cpu/bias_gate.cpp): 1 / (1 + e^-z) for z >= 0, e^z / (1 + e^z)
// otherwise, f32 operations (IEEE division) on exp_f32.
__device__ __forceinline__ float sigmoid_f32(float z) {
  if (z >= 0.0f) return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-z)));
  const float e = exp_f32(z);
  return __fdiv_rn(e, __fadd_rn(1.0f, e));
}

// One warp's row: out[c] = s * g[c] (f32, or rounded to bf16) for c < d, and returns the dot
// product g . r in double to every lane. Each lane sums its columns (lane, lane + 32, ...) in
// order (the products of two floats are exact in double), then the 32 partial sums meet in a
// butterfly: a fixed order set by d alone, so the bits are the same on every run (the CPU sums
// the columns left to right: the two differ by double roundings, far below the f32 result's).
template <class Y, class D>
__device__ __forceinline__ double scaled_copy_dot(const float* __restrict__ g,
                                                  const Y* __restrict__ r, int64_t d, float s,
                                                  D* __restrict__ out, int lane) {
  double dot = 0.0;
  for (int64_t c = lane; c < d; c += 32) {
    const float gc = g[c];
    dot = __dadd_rn(dot, __dmul_rn(double(gc), double(widen(r[c]))));
    put(out + c, __fmul_rn(s, gc));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) dot = __dadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
  return dot;
}

}  // namespace loom::cuda
