#pragma once
// Rotary position embedding in the Hugging Face Llama convention (rotate_half: dimension i pairs
// with i + D/2), with Llama 3.1 frequency scaling.
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"

namespace loom {

// Plain configuration and table types, outside `cpu::`: a model's config holds them whatever
// backend runs its kernels.
struct RopeScaling {
  bool llama3 = false;  // rope_scaling.rope_type == "llama3"
  double factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  double original_max_position = 8192;
};

// cos/sin tables [num_positions, D/2] for positions 0..num_positions-1.
struct RopeTable {
  int64_t head_dim = 0, num_positions = 0;
  std::vector<float> cos, sin;
};

}  // namespace loom

namespace loom::cpu {

using loom::RopeScaling;
using loom::RopeTable;

// inv_freq[i] for i < D/2, after scaling.
std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& s);

RopeTable rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s);

// x is [B, T, H, D] (token-major, as a GEMM writes it), rotated in place; positions[t] (length T,
// shared by the batch) are global positions into the table. x may be a strided view: `row_stride`
// is the distance in floats between consecutive tokens (>= H*D), e.g. when q sits inside a fused
// qkv buffer.
void rope_forward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                  const int32_t* positions, const RopeTable& table);
// The inverse rotation, applied in place to the gradient.
void rope_backward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                   const int32_t* positions, const RopeTable& table);

// Mixed precision's qkv in one pass: each token's row of x (f32, `x_stride` floats apart) goes to
// `out` (bf16, `out_stride` apart) with its first H heads rotated (by the negative angle when
// `backward`) and the next Hc heads copied, every element rounded to bf16: the bits of
// rope_forward (rope_backward) in place followed by a cast, without writing x back or reading it
// twice; only an f32 denormal differs where avx512_bf16_native() holds (vcvtneps2bf16 flushes it
// to zero, as oneDNN's bf16 outputs; `out` is an operand of the attention or a GEMM).
void rope_rounded(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                  int64_t x_stride, const int32_t* positions, const RopeTable& table, bool backward,
                  bf16* out, int64_t out_stride);

}  // namespace loom::cpu
