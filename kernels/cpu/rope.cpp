#include "kernels/cpu/rope.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/rope.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// fn(row, cos, sin) for every token's row, over the thread team: the table's rows at its position.
template <class Fn>
void for_each_token(int64_t B, int64_t T, const int32_t* positions, const RopeTable& table,
                    Fn&& fn) {
  const int64_t half = table.head_dim / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t pos = positions[bt % T];
    fn(bt, table.cos.data() + pos * half, table.sin.data() + pos * half);
  }
}

// sign = +1 rotates by +angle (forward), -1 by -angle (backward, the transpose).
template <int Sign>
void rotate(float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
            const int32_t* positions, const RopeTable& table) {
  const int64_t half = D / 2;
  for_each_token(B, T, positions, table,
                 [&](int64_t bt, const float* __restrict c, const float* __restrict s) {
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
                 });
}

// Vectors of the target's width (store_bf16_operand rounds them: the output is an operand of the
// bf16 attention or GEMM), and on AVX-512 of 8 floats too (the rest of a half head: D 48 is 16 + 8
// pairs); vector_size cannot depend on a template parameter.
inline void put(bf16* p, vf x, bool native) {
  store_bf16_operand(p, x, native);
}
inline vf load_n(const float* p, vf) {
  return load(p);
}
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define LOOM_ROPE_HALF_LANES 1
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v8hu __attribute__((vector_size(16), aligned(2), may_alias));
inline void put(bf16* p, v8f x, bool native) {
  if (native) {  // vcvtneps2bf16 on 8 lanes, as store_bf16_operand on 16
    __m128i r;
    asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(x));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), r);
    return;
  }
  *reinterpret_cast<v8hu*>(p) = __builtin_convertvector(bf16_bits(__builtin_bit_cast(v8u, x)), v8h);
}
inline v8f load_n(const float* p, v8f) {
  return *reinterpret_cast<const v8fu*>(p);
}
#endif

// Pairs i .. n of a head with vectors V while they last; returns where they stopped.
template <int Sign, class V>
int64_t rotate_lanes(const float* x1, const float* x2, const float* c, const float* s, bf16* o1,
                     bf16* o2, int64_t i, int64_t n, bool native) {
  constexpr int64_t N = sizeof(V) / 4;
  for (; i + N <= n; i += N) {
    const V a = load_n(x1 + i, V{}), b = load_n(x2 + i, V{}), ci = load_n(c + i, V{});
    const V si = float(Sign) * load_n(s + i, V{});
    put(o1 + i, a * ci - b * si, native);
    put(o2 + i, b * ci + a * si, native);
  }
  return i;
}

// rotate<Sign> and a cast in one pass: the same expressions, so the same f32 values are rounded.
template <int Sign>
void rotate_rounded(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                    int64_t x_stride, const int32_t* positions, const RopeTable& table, bf16* out,
                    int64_t out_stride, bool native) {
  const int64_t half = D / 2;
  for_each_token(B, T, positions, table, [&](int64_t bt, const float* c, const float* s) {
    const float* row = x + bt * x_stride;
    bf16* orow = out + bt * out_stride;
    for (int64_t h = 0; h < H; ++h) {
      const float* x1 = row + h * D;
      const float* x2 = x1 + half;
      bf16* o1 = orow + h * D;
      bf16* o2 = o1 + half;
      int64_t i = rotate_lanes<Sign, vf>(x1, x2, c, s, o1, o2, 0, half, native);
#ifdef LOOM_ROPE_HALF_LANES
      i = rotate_lanes<Sign, v8f>(x1, x2, c, s, o1, o2, i, half, native);
#endif
      for (; i < half; ++i) {
        const float a = x1[i], b = x2[i], si = Sign * s[i];
        o1[i] = to_bf16_operand(a * c[i] - b * si, native);
        o2[i] = to_bf16_operand(b * c[i] + a * si, native);
      }
    }
    const float* rest = row + H * D;
    bf16* orest = orow + H * D;
    const int64_t n = Hc * D;
    int64_t j = 0;
    for (; j + kW <= n; j += kW) store_bf16_operand(orest + j, load(rest + j), native);
    for (; j < n; ++j) orest[j] = to_bf16_operand(rest[j], native);
  });
}

#undef LOOM_ROPE_HALF_LANES

}  // namespace

void rope_rounded_impl(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                       int64_t x_stride, const int32_t* positions, const RopeTable& table,
                       bool backward, bf16* out, int64_t out_stride, bool native) {
  if (backward)
    rotate_rounded<-1>(x, B, T, H, Hc, D, x_stride, positions, table, out, out_stride, native);
  else
    rotate_rounded<1>(x, B, T, H, Hc, D, x_stride, positions, table, out, out_stride, native);
}

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
HWY_EXPORT(rope_rounded_impl);

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

namespace {

void check_rounded(const char* who, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                   int64_t x_stride, const int32_t* positions, const RopeTable& table,
                   int64_t out_stride) {
  LOOM_CHECK(Hc >= 0, who, ": Hc must be >= 0, got ", Hc);
  check_args(who, B, T, H + Hc, D, x_stride, positions, table);
  LOOM_CHECK(out_stride >= (H + Hc) * D, who, ": out_stride (", out_stride,
             ") must be >= (H+Hc)*D (", (H + Hc) * D, ")");
}

}  // namespace

void rope_rounded(const float* x, int64_t B, int64_t T, int64_t H, int64_t Hc, int64_t D,
                  int64_t x_stride, const int32_t* positions, const RopeTable& table, bool backward,
                  bf16* out, int64_t out_stride) {
  check_rounded(backward ? "rope_rounded (backward)" : "rope_rounded", B, T, H, Hc, D, x_stride,
                positions, table, out_stride);
  LOOM_DISPATCH(rope_rounded_impl)
  (x, B, T, H, Hc, D, x_stride, positions, table, backward, out, out_stride, avx512_bf16_native());
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
