#include "kernels/cpu/rope.hpp"

#include <cmath>
#include <numbers>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/rope.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle (backward, the transpose).
template <int Sign>
void rotate(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
            const int32_t* positions, const RopeTable& table) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t pos = positions[bt % T];
    const float* __restrict c = table.cos.data() + pos * half;
    const float* __restrict s = table.sin.data() + pos * half;
    float* row = x + bt * row_stride;
    for (int64_t h = 0; h < H; ++h) {
      float* __restrict x1 = row + h * D;
      float* __restrict x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i], si = Sign * s[i];
        x1[i] = a * c[i] - b * si;
        x2[i] = b * c[i] + a * si;
      }
    }
  }
}

}  // namespace

void rope_forward_impl(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                       const int32_t* positions, const RopeTable& table) {
  rotate<1>(x, B, T, H, D, row_stride, positions, table);
}

void rope_backward_impl(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                        const int32_t* positions, const RopeTable& table) {
  rotate<-1>(dx, B, T, H, D, row_stride, positions, table);
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {

std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& s) {
  LOOM_CHECK(head_dim > 0 && head_dim % 2 == 0,
             "rope_inv_freq: head_dim must be even and > 0, got ", head_dim);
  LOOM_CHECK(std::isfinite(theta) && theta > 0, "rope_inv_freq: theta must be finite and > 0, got ",
             theta);
  const int64_t half = head_dim / 2;
  std::vector<double> f(half);
  for (int64_t i = 0; i < half; ++i) f[i] = std::pow(theta, -2.0 * double(i) / double(head_dim));
  if (!s.llama3) return f;
  LOOM_CHECK(s.factor > 0, "rope_inv_freq: llama3 factor must be > 0, got ", s.factor);
  LOOM_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
             "rope_inv_freq: llama3 needs 0 < low_freq_factor < high_freq_factor, got low=",
             s.low_freq_factor, " high=", s.high_freq_factor);
  LOOM_CHECK(s.original_max_position > 0,
             "rope_inv_freq: llama3 original_max_position must be > 0, got ",
             s.original_max_position);
  const double old = s.original_max_position;
  const double low_wavelen = old / s.low_freq_factor;
  const double high_wavelen = old / s.high_freq_factor;
  for (auto& x : f) {
    const double wavelen = 2 * std::numbers::pi / x;
    if (wavelen < high_wavelen) continue;  // high frequencies are kept
    if (wavelen > low_wavelen) {
      x /= s.factor;  // low frequencies are interpolated
    } else {
      const double smooth =
          (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      x = (1 - smooth) * x / s.factor + smooth * x;
    }
  }
  return f;
}

RopeTable rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s) {
  LOOM_CHECK(num_positions > 0, "rope_table: num_positions must be > 0, got ", num_positions);
  const std::vector<double> f = rope_inv_freq(head_dim, theta, s);
  const int64_t half = head_dim / 2;
  RopeTable t;
  t.head_dim = head_dim;
  t.num_positions = num_positions;
  t.cos.resize(num_positions * half);
  t.sin.resize(num_positions * half);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < num_positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double a = double(p) * f[i];
      t.cos[p * half + i] = float(std::cos(a));
      t.sin[p * half + i] = float(std::sin(a));
    }
  }
  return t;
}

namespace {

void check_args(const char* who, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                const int32_t* positions, const RopeTable& table) {
  LOOM_CHECK(B >= 0 && T >= 0 && H >= 0, who, ": B, T, H must be >= 0, got B=", B, " T=", T,
             " H=", H);
  LOOM_CHECK(D == table.head_dim, who, ": head dim ", D, " does not match the table's ",
             table.head_dim);
  LOOM_CHECK(row_stride >= H * D, who, ": row_stride (", row_stride, ") must be >= H*D (", H * D,
             ")");
  LOOM_CHECK(T == 0 || positions, who, ": positions is null");
  for (int64_t t = 0; t < T; ++t)
    LOOM_CHECK(positions[t] >= 0 && positions[t] < table.num_positions, who, ": positions[", t,
               "] = ", positions[t], " is outside the table [0, ", table.num_positions, ")");
}

}  // namespace

HWY_EXPORT(rope_forward_impl);
HWY_EXPORT(rope_backward_impl);

void rope_forward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                  const int32_t* positions, const RopeTable& table) {
  check_args("rope_forward", B, T, H, D, row_stride, positions, table);
  LOOM_DISPATCH(rope_forward_impl)(x, B, T, H, D, row_stride, positions, table);
}

void rope_backward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                   const int32_t* positions, const RopeTable& table) {
  check_args("rope_backward", B, T, H, D, row_stride, positions, table);
  LOOM_DISPATCH(rope_backward_impl)(dx, B, T, H, D, row_stride, positions, table);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
