#include "kernels/cpu/rmsnorm.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/rmsnorm.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// Rows are parallel work; below this many elements the thread team costs more than it saves.
constexpr int64_t kParallelMin = int64_t{1} << 14;

// dw is summed per chunk of rows, then the chunk partials are added in chunk order. The chunking
// depends only on `rows`, so dw has the same bits for any thread count. 64 chunks keep every
// thread of a large socket busy while the partials (64 x dim floats) stay small next to the
// inputs (3 x rows x dim floats).
constexpr int64_t kMaxChunks = 64;

}  // namespace

namespace {

// Out is float, or bf16: each element rounded by float_to_bf16 right where the f32 kernel would
// store it, so the bits equal those of the f32 output cast afterwards (cast_f32_to_bf16).
inline void put(float& dst, float v) {
  dst = v;
}
inline void put(bf16& dst, float v) {
  dst = float_to_bf16(v);
}

// One row: y = x * rstd * w; returns rstd.
template <class T>
inline float norm_row(const float* __restrict xr, const float* __restrict wr, int64_t dim,
                      float inv_dim, float eps, T* __restrict yr) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
  const float rs = 1.0f / std::sqrt(ss * inv_dim + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) put(yr[i], xr[i] * rs * wr[i]);
  return rs;
}

template <class T>
void rmsnorm_forward_t(const float* x, const float* w, int64_t rows, int64_t dim, float eps, T* y,
                       float* rstd) {
  const float inv_dim = 1.0f / float(dim);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    rstd[r] = norm_row(x + r * dim, w, dim, inv_dim, eps, y + r * dim);
}

}  // namespace

void rmsnorm_forward_impl(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                          float* y, float* rstd) {
  rmsnorm_forward_t(x, w, rows, dim, eps, y, rstd);
}
void rmsnorm_forward_bf16_impl(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                               bf16* y, float* rstd) {
  rmsnorm_forward_t(x, w, rows, dim, eps, y, rstd);
}

// Each row rounded first (in place and into x16, while it is in L1), then normed by the same
// row code as rmsnorm_forward_t.
void rmsnorm_forward_rounding_input_impl(float* x, bf16* x16, const float* w, int64_t rows,
                                         int64_t dim, float eps, bf16* y, float* rstd) {
  const float inv_dim = 1.0f / float(dim);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict xr = x + r * dim;
    bf16* __restrict hr = x16 + r * dim;
    int64_t i = 0;
    for (; i + kW <= dim; i += kW) {
      store_bf16(hr + i, load(xr + i));
      store(xr + i, load_bf16(hr + i));
    }
    for (; i < dim; ++i) {
      hr[i] = float_to_bf16(xr[i]);
      xr[i] = bf16_to_float(hr[i]);
    }
    rstd[r] = norm_row(xr, w, dim, inv_dim, eps, y + r * dim);
  }
}

namespace {

// x as float, or bf16 widened (exactly) where it is read: the same values. The backward's loops
// are written in explicit vectors so that both kinds of x run the same arithmetic in the same
// order (under `omp simd` GCC vectorized the bf16 loads at another width, and dx differed in the
// last bits from the f32 kernel on the widened copy).
inline float value(float v) {
  return v;
}
inline float value(bf16 v) {
  return bf16_to_float(v);
}
inline vf load_x(const float* p) {
  return load(p);
}
inline vf load_x(const bf16* p) {
  return load_bf16(p);
}

}  // namespace

// With xhat = x * rstd and g = dy * w:
//   dx = rstd * (g - xhat * mean(g * xhat)),  dw = sum over rows of dy * xhat.
template <class X>
void rmsnorm_backward_t(const float* dy, const X* x, const float* w, const float* rstd,
                        int64_t rows, int64_t dim, float* dx, float* dw) {
  const int64_t chunk_rows = (rows + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  std::vector<float> partial(size_t(chunks * dim));
  const float inv_dim = 1.0f / float(dim);
  const bool parallel = rows * dim >= kParallelMin;

#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t c = 0; c < chunks; ++c) {
    float* __restrict pw = partial.data() + c * dim;
    const float* __restrict wr = w;
    const int64_t r_end = std::min(rows, (c + 1) * chunk_rows);
    for (int64_t r = c * chunk_rows; r < r_end; ++r) {
      const float* __restrict dyr = dy + r * dim;
      const X* __restrict xr = x + r * dim;
      float* __restrict dxr = dx + r * dim;
      const float rs = rstd[r];
      const int64_t vend = dim / kW * kW;
      vf dotv{};  // sum(g * x); times rstd it is sum(g * xhat)
      for (int64_t i = 0; i < vend; i += kW) dotv += load(dyr + i) * load(wr + i) * load_x(xr + i);
      float dot = reduce_add(dotv);
      for (int64_t i = vend; i < dim; ++i) dot += dyr[i] * wr[i] * value(xr[i]);
      const float k = dot * rs * rs * inv_dim;
      const bool first = r == c * chunk_rows;
      for (int64_t i = 0; i < vend; i += kW) {
        const vf xi = load_x(xr + i), dyi = load(dyr + i);
        store(dxr + i, load(dxr + i) + rs * (dyi * load(wr + i) - xi * k));
        const vf p = dyi * xi * rs;
        store(pw + i, first ? p : load(pw + i) + p);
      }
      for (int64_t i = vend; i < dim; ++i) {
        const float xi = value(xr[i]);
        dxr[i] += rs * (dyr[i] * wr[i] - xi * k);
        pw[i] = first ? dyr[i] * xi * rs : pw[i] + dyr[i] * xi * rs;
      }
    }
  }

  // Column blocks so that the chunk loop is outside and the column loop vectorizes.
  constexpr int64_t kCols = 256;
  const int64_t col_blocks = (dim + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (parallel && col_blocks > 1)
  for (int64_t b = 0; b < col_blocks; ++b) {
    const int64_t lo = b * kCols, len = std::min(kCols, dim - lo);
    float acc[kCols];
    std::copy_n(partial.data() + lo, len, acc);
    for (int64_t c = 1; c < chunks; ++c) {
      const float* __restrict pc = partial.data() + c * dim + lo;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) acc[i] += pc[i];
    }
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) dw[lo + i] += acc[i];
  }
}

void rmsnorm_backward_impl(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t rows, int64_t dim, float* dx, float* dw) {
  rmsnorm_backward_t(dy, x, w, rstd, rows, dim, dx, dw);
}
void rmsnorm_backward_bf16_impl(const float* dy, const bf16* x, const float* w, const float* rstd,
                                int64_t rows, int64_t dim, float* dx, float* dw) {
  rmsnorm_backward_t(dy, x, w, rstd, rows, dim, dx, dw);
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_args(const char* what, int64_t rows, int64_t dim) {
  LOOM_CHECK(rows >= 0, what, ": rows must be >= 0, got ", rows);
  LOOM_CHECK(dim > 0, what, ": dim must be > 0, got ", dim);
}

}  // namespace

HWY_EXPORT(rmsnorm_forward_impl);
HWY_EXPORT(rmsnorm_backward_impl);
HWY_EXPORT(rmsnorm_forward_bf16_impl);
HWY_EXPORT(rmsnorm_backward_bf16_impl);
HWY_EXPORT(rmsnorm_forward_rounding_input_impl);

void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                     float* rstd) {
  check_args("rmsnorm_forward", rows, dim);
  LOOM_CHECK(eps >= 0, "rmsnorm_forward: eps must be >= 0, got ", eps);
  LOOM_DISPATCH(rmsnorm_forward_impl)(x, w, rows, dim, eps, y, rstd);
}

void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, bf16* y,
                     float* rstd) {
  check_args("rmsnorm_forward", rows, dim);
  LOOM_CHECK(eps >= 0, "rmsnorm_forward: eps must be >= 0, got ", eps);
  LOOM_DISPATCH(rmsnorm_forward_bf16_impl)(x, w, rows, dim, eps, y, rstd);
}

void rmsnorm_forward_rounding_input(float* x, bf16* x16, const float* w, int64_t rows, int64_t dim,
                                    float eps, bf16* y, float* rstd) {
  check_args("rmsnorm_forward_rounding_input", rows, dim);
  LOOM_CHECK(eps >= 0, "rmsnorm_forward_rounding_input: eps must be >= 0, got ", eps);
  LOOM_DISPATCH(rmsnorm_forward_rounding_input_impl)(x, x16, w, rows, dim, eps, y, rstd);
}

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw) {
  check_args("rmsnorm_backward", rows, dim);
  if (rows == 0) return;
  LOOM_DISPATCH(rmsnorm_backward_impl)(dy, x, w, rstd, rows, dim, dx, dw);
}

void rmsnorm_backward(const float* dy, const bf16* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw) {
  check_args("rmsnorm_backward", rows, dim);
  if (rows == 0) return;
  LOOM_DISPATCH(rmsnorm_backward_bf16_impl)(dy, x, w, rstd, rows, dim, dx, dw);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
