#pragma once
// What the two flash attention tests share (tests/kernels/flash_attention_emulation_test.cpp on the
// CPU, tests/kernels/cuda/flash_attention_test.cpp on the GPU): the bounds, and the logical columns
// of a strided buffer.
#include <cstdint>
#include <vector>

namespace loom::test::flash {

// tests/kernels/attention_bf16_test.cpp's bounds between the bf16 and the f32 kernels (relative
// L2; lse relative to max(1, |lse|)).
constexpr double kFwdTol = 4e-3;
constexpr double kLseTol = 1e-5;
constexpr double kDvTol = 5e-3;
constexpr double kDqkTol = 1.5e-2;

// Columns [col0, col0 + width) of every row of a [rows, stride] buffer, dense.
inline std::vector<float> columns(const std::vector<float>& a, int64_t rows, int64_t stride,
                                  int64_t col0, int64_t width) {
  std::vector<float> r;
  r.reserve(size_t(rows * width));
  for (int64_t i = 0; i < rows; ++i)
    r.insert(r.end(), a.begin() + i * stride + col0, a.begin() + i * stride + col0 + width);
  return r;
}

}  // namespace loom::test::flash
