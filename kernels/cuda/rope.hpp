#pragma once
// Rotary position embedding on the device: the counterparts of kernels/cpu/rope.hpp, in the same
// Hugging Face convention (rotate_half: dimension i of a head pairs with i + D/2) and with the same
// expressions per pair:
//   x1' = x1 * cos - x2 * sin',  x2' = x2 * cos + x1 * sin',  sin' = +sin (forward), -sin
//   (backward)
// Pointers are device memory; the work is queued on the compute stream (kernels/cuda/runtime.hpp)
// and nothing waits for it. nvcc fuses a product and a sum into one FMA where the CPU's compiler
// may choose another pair (or none): f32 results may differ from the CPU's in the last bits.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cuda {

// A RopeTable (kernels/cpu/rope.hpp) uploaded by the caller: cos and sin are device arrays of
// [num_positions, head_dim / 2] floats, the table's vectors as they are.
struct RopeDeviceTable {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t head_dim = 0, num_positions = 0;
};

// x is [B, T, H, D] (token-major), rotated in place; row_stride (>= H*D) floats between
// consecutive tokens (q inside a fused qkv buffer). positions is a device array of T int32 (shared
// by the batch): the caller checks them against the table on the host, where it has them (ops hold
// them as a host vector); the kernel never reads outside the table, and a position outside
// [0, num_positions) turns that token's rotated heads into NaN rather than reading out of bounds.
void rope_forward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                  const int32_t* positions, const RopeDeviceTable& table);
// The inverse rotation (by the negative angle), applied in place to the gradient.
void rope_backward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                   const int32_t* positions, const RopeDeviceTable& table);

// Mixed precision's qkv in one pass: each token's row of x (f32, x_stride floats apart) goes to
// out (bf16, out_stride apart) with its first H heads rotated (by the negative angle when
// `backward`) and the next Hc heads copied, every element rounded by f32_to_bf16_bits: the bits
// of this file's rope_forward (rope_backward) in place followed by a cast; x is not written. out
// must not overlap x. Positions as above (NaN in the rotated heads for one outside the table).
void rope_rounded(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                  int64_t x_stride, const int32_t* positions, const RopeDeviceTable& table,
                  bool backward, bf16* out, int64_t out_stride);

}  // namespace loom::cuda
