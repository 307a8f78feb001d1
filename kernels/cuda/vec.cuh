#pragma once
// Device helpers of the bandwidth-bound kernels: bf16 rounding with the CPU engine's bits, and
// 16-byte vectors (8 bf16 or 4 floats per access).
#include <cstdint>

namespace loom::cuda {

// float_to_bf16 of core/dtype.hpp on the device: round to nearest even, a NaN stays a quiet NaN
// with its sign and high payload (the same 16 bits as the CPU engine's software rounding; no
// flush of denormals).
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
// Two bf16 in one word, the lower element in the low half (little endian, as in memory).
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return uint32_t(f32_to_bf16_bits(lo)) | (uint32_t(f32_to_bf16_bits(hi)) << 16);
}
__device__ __forceinline__ float lo_of(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float hi_of(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}

// Whether every pointer is 16-byte aligned (then the 16-byte path runs).
__host__ __device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// The row kernels' vectors: N consecutive elements at p, widened to float, and stored back (bf16
// rounded by f32_to_bf16_bits).
// N = 1 (any alignment), or N = 4 / 8 (p aligned to N elements: 16-byte accesses, 8 bytes for
// 4 bf16).
template <int N>
__device__ __forceinline__ void load(const float* p, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float4 q = reinterpret_cast<const float4*>(p)[k];
      v[4 * k] = q.x;
      v[4 * k + 1] = q.y;
      v[4 * k + 2] = q.z;
      v[4 * k + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = p[k];
  }
}
template <int N>
__device__ __forceinline__ void load(const uint16_t* p, float (&v)[N]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int k = 0; k < N / 8; ++k) {
      const uint4 q = reinterpret_cast<const uint4*>(p)[k];
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[8 * k + 2 * e] = lo_of(w[e]);
        v[8 * k + 2 * e + 1] = hi_of(w[e]);
      }
    }
  } else if constexpr (N == 4) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    v[0] = lo_of(q.x);
    v[1] = hi_of(q.x);
    v[2] = lo_of(q.y);
    v[3] = hi_of(q.y);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = bf16_bits_to_f32(p[k]);
  }
}
// Stores N floats, or N bf16 rounded by f32_to_bf16_bits (the CPU's float_to_bf16).
template <int N>
__device__ __forceinline__ void store(float* p, const float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k)
      reinterpret_cast<float4*>(p)[k] =
          make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = v[k];
  }
}
template <int N>
__device__ __forceinline__ void store(uint16_t* p, const float (&v)[N]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int k = 0; k < N / 8; ++k)
      reinterpret_cast<uint4*>(p)[k] =
          make_uint4(pack2(v[8 * k], v[8 * k + 1]), pack2(v[8 * k + 2], v[8 * k + 3]),
                     pack2(v[8 * k + 4], v[8 * k + 5]), pack2(v[8 * k + 6], v[8 * k + 7]));
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2(v[0], v[1]), pack2(v[2], v[3]));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = f32_to_bf16_bits(v[k]);
  }
}

}  // namespace loom::cuda
