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

}  // namespace loom::cuda
