#include "kernels/cuda/gla_ops.hpp"

#include <algorithm>
#include <climits>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Blocks of the element-wise kernels: at most this many (a grid-stride loop beyond).
constexpr unsigned kMaxBlocks = 1u << 20;
// The partial sums' blocks: 32 columns x 8 row lanes (lane y takes rows y, y + 8, ... of the
// range; the 8 lanes' sums are then added in lane order).
constexpr int kCols = 32, kRowLanes = 8;

// ---- device helpers ----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}
// logsigmoid(x) = min(x, 0) - log1p(e^-|x|): never e of a large positive number.
__device__ __forceinline__ float logsigmoid(float x) {
  return fminf(x, 0.0f) - log1pf(expf(-fabsf(x)));
}
// sigmoid(-x) from y = e^-|x|: y / (1 + y) for x >= 0, 1 / (1 + y) otherwise (the CPU's form).
__device__ __forceinline__ float sigmoid_neg(float x) {
  const float y = expf(-fabsf(x));
  return (x < 0.0f ? 1.0f : y) / (1.0f + y);
}

// The rows [r0, r1) of range c.
struct Range {
  int64_t r0, r1;
};
__device__ __forceinline__ Range range_of(int64_t c, int64_t chunk_rows, int64_t rows) {
  const int64_t r0 = c * chunk_rows;
  return {r0, r0 + chunk_rows < rows ? r0 + chunk_rows : rows};
}

// out[j] += the sum over p of partial[p, j] (p in order; partial [parts, width]).
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const float* __restrict__ partial, int64_t parts, int64_t width,
                        float* __restrict__ out) {
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= width) return;
  float t = partial[j];
  for (int64_t p = 1; p < parts; ++p) t += partial[p * width + j];
  out[j] += t;
}

// ---- the gate ----------------------------------------------------------------------------------

// gk = max(logsigmoid(z + bias) * inv, clamp_min) element-wise (gk may be z: each element is read
// and then written by one thread).
__global__ void __launch_bounds__(kThreads)
    gate_forward_kernel(const float* z, const float* __restrict__ bias, int64_t n, int64_t width,
                        float inv, float clamp_min, float* gk) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const float g = logsigmoid(z[e] + (bias ? bias[e % width] : 0.0f)) * inv;
    gk[e] = g < clamp_min ? clamp_min : g;
  }
}

// dz = (dgk * sigmoid(-(z + bias))) * inv, 0 where logsigmoid(z + bias) * inv < clamp_min, for
// the rows of range blockIdx.y and 32 columns (dz may be dgk). With `partial`, the range's column
// sums of dz into partial[blockIdx.y, :].
__global__ void __launch_bounds__(kCols* kRowLanes)
    gate_backward_kernel(const float* dgk, const float* __restrict__ z,
                         const float* __restrict__ bias, int64_t rows, int64_t width,
                         int64_t chunk_rows, float inv, float clamp_min, float* dz,
                         float* __restrict__ partial) {
  __shared__ float sums[kRowLanes][kCols];
  const int64_t j = int64_t(blockIdx.x) * kCols + threadIdx.x;
  const Range rg = range_of(blockIdx.y, chunk_rows, rows);
  float acc = 0.0f;
  if (j < width) {
    const float bj = bias ? bias[j] : 0.0f;
    for (int64_t r = rg.r0 + threadIdx.y; r < rg.r1; r += kRowLanes) {
      const int64_t e = r * width + j;
      const float zi = z[e] + bj;
      const float d = dgk[e] * sigmoid_neg(zi) * inv;
      const float out = logsigmoid(zi) * inv < clamp_min ? 0.0f : d;
      dz[e] = out;
      acc += out;
    }
  }
  if (!partial) return;  // the same for the whole block
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < width) {
    float t = sums[0][threadIdx.x];
    for (int y = 1; y < kRowLanes; ++y) t += sums[y][threadIdx.x];
    partial[int64_t(blockIdx.y) * width + j] = t;
  }
}

// ---- the gated RMSNorm -------------------------------------------------------------------------

// One warp per (row, head) item (item = m*heads + h): ss by lane-strided fmaf then a butterfly,
// rs = 1/sqrt(ss/dim + eps), y = (x rs) w, times g sigmoid(g) with a gate.
__global__ void __launch_bounds__(kThreads)
    grn_forward_kernel(GatedRmsNorm s, const float* __restrict__ x, const float* __restrict__ g,
                       int64_t ldg, const float* __restrict__ w, float* __restrict__ y,
                       float* __restrict__ rstd) {
  const int64_t D = s.dim, HD = s.heads * D, items = s.rows * s.heads;
  const float inv_dim = 1.0f / float(D);
  const int lane = int(threadIdx.x) % 32;
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t it = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; it < items; it += step) {
    const int64_t m = it / s.heads, h = it % s.heads;
    const float* xr = x + m * HD + h * D;
    float* yr = y + m * HD + h * D;
    float ss = 0.0f;
    for (int64_t i = lane; i < D; i += 32) ss = fmaf(xr[i], xr[i], ss);
    const float rs = 1.0f / sqrtf(fmaf(warp_sum(ss), inv_dim, s.eps));
    if (lane == 0) rstd[it] = rs;
    for (int64_t i = lane; i < D; i += 32) {
      float v = xr[i] * rs * (w ? w[i] : 1.0f);
      if (g) {
        const float gi = g[m * ldg + h * D + i];
        v *= gi * sigmoid(gi);
      }
      yr[i] = v;
    }
  }
}

// The items of range blockIdx.x (its rows, every head), warp w taking the range's items w, w + 8,
// ... With n = x rstd, sw = g sigmoid(g) (1 without a gate):
//   dg = dy (n w) sigmoid(g) (1 + g (1 - sigmoid(g))),  dn = dy w sw,
//   dx = rstd (dn - n mean(dn n)),  partial row (blockIdx.x * 8 + w) += dy n sw.
__global__ void __launch_bounds__(kThreads)
    grn_backward_kernel(GatedRmsNorm s, const float* __restrict__ dy, const float* __restrict__ x,
                        const float* __restrict__ g, int64_t ldg, const float* __restrict__ w,
                        const float* __restrict__ rstd, float* __restrict__ dx,
                        float* __restrict__ dg, int64_t lddg, int64_t chunk_rows,
                        float* __restrict__ partial) {
  const int64_t D = s.dim, HD = s.heads * D;
  const float inv_dim = 1.0f / float(D);
  const int lane = int(threadIdx.x) % 32, wp = int(threadIdx.x) / 32;
  const Range rg = range_of(blockIdx.x, chunk_rows, s.rows);
  float* pw = partial ? partial + (int64_t(blockIdx.x) * kWarps + wp) * D : nullptr;
  if (pw)
    for (int64_t i = lane; i < D; i += 32) pw[i] = 0.0f;
  const int64_t items = (rg.r1 - rg.r0) * s.heads;
  for (int64_t li = wp; li < items; li += kWarps) {
    const int64_t m = rg.r0 + li / s.heads, h = li % s.heads;
    const int64_t off = m * HD + h * D;
    const float rs = rstd[m * s.heads + h];
    const float* gr = g ? g + m * ldg + h * D : nullptr;
    float dot = 0.0f;
    for (int64_t i = lane; i < D; i += 32) {
      const float xi = x[off + i], dyi = dy[off + i], wi = w ? w[i] : 1.0f;
      float sw = 1.0f;
      if (gr) {
        const float gi = gr[i], sg = sigmoid(gi);
        dg[m * lddg + h * D + i] = dyi * (xi * rs * wi) * sg * (1.0f + gi * (1.0f - sg));
        sw = gi * sg;
      }
      dot = fmaf(dyi * wi * sw * xi, rs, dot);
    }
    const float k = warp_sum(dot) * inv_dim;
    for (int64_t i = lane; i < D; i += 32) {
      const float xi = x[off + i], dyi = dy[off + i], wi = w ? w[i] : 1.0f;
      const float sw = gr ? gr[i] * sigmoid(gr[i]) : 1.0f;
      const float n = xi * rs;
      dx[off + i] = rs * (dyi * wi * sw - n * k);
      if (pw) pw[i] += dyi * n * sw;
    }
  }
}

// ---- the short convolution ---------------------------------------------------------------------

// u of element (row, ch): sum_j w[ch, j] x[row - W + 1 + j, ch] over the taps inside the sample,
// in tap order.
__device__ __forceinline__ float conv_at(const ShortConv& s, const float* __restrict__ x,
                                         int64_t ldx, const float* __restrict__ w, int64_t row,
                                         int64_t ch) {
  const int64_t t = row % s.T;
  float u = 0.0f;
  for (int64_t j = s.W - 1 - t > 0 ? s.W - 1 - t : 0; j < s.W; ++j)
    u = fmaf(w[ch * s.W + j], x[(row - s.W + 1 + j) * ldx + ch], u);
  return u;
}

__global__ void __launch_bounds__(kThreads)
    conv_forward_kernel(ShortConv s, const float* __restrict__ x, int64_t ldx,
                        const float* __restrict__ w, float* __restrict__ y, int64_t ldy) {
  const int64_t n = s.B * s.T * s.C, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t row = e / s.C, ch = e % s.C;
    const float u = conv_at(s, x, ldx, w, row, ch);
    y[row * ldy + ch] = u * sigmoid(u);
  }
}

// du = dy silu'(u) = dy sigmoid(u) (1 + u (1 - sigmoid(u))) into du [B*T, C] (contiguous).
__global__ void __launch_bounds__(kThreads)
    conv_du_kernel(ShortConv s, const float* __restrict__ dy, int64_t lddy,
                   const float* __restrict__ x, int64_t ldx, const float* __restrict__ w,
                   float* __restrict__ du) {
  const int64_t n = s.B * s.T * s.C, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t row = e / s.C, ch = e % s.C;
    const float u = conv_at(s, x, ldx, w, row, ch), sg = sigmoid(u);
    du[e] = dy[row * lddy + ch] * sg * (1.0f + u * (1.0f - sg));
  }
}

// dx_t[ch] = sum_j w[ch, j] du_{t+W-1-j}[ch] over the taps whose output is inside the sample (tap
// order, the CPU's).
__global__ void __launch_bounds__(kThreads)
    conv_dx_kernel(ShortConv s, const float* __restrict__ du, const float* __restrict__ w,
                   float* __restrict__ dx, int64_t lddx) {
  const int64_t n = s.B * s.T * s.C, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t row = e / s.C, ch = e % s.C, t = row % s.T;
    float acc = 0.0f;
    for (int64_t j = 0; j < s.W; ++j) {
      const int64_t ahead = s.W - 1 - j;
      if (t + ahead < s.T) acc = fmaf(w[ch * s.W + j], du[(row + ahead) * s.C + ch], acc);
    }
    dx[row * lddx + ch] = acc;
  }
}

// partial[range, ch, j] = sum over the range's rows r (input rows) of du_{r+W-1-j}[ch] x_r[ch],
// where that output row is inside the sample.
__global__ void __launch_bounds__(kCols* kRowLanes)
    conv_dw_kernel(ShortConv s, const float* __restrict__ du, const float* __restrict__ x,
                   int64_t ldx, int64_t chunk_rows, float* __restrict__ partial) {
  __shared__ float sums[kRowLanes][kCols];
  const int64_t ch = int64_t(blockIdx.x) * kCols + threadIdx.x;
  const Range rg = range_of(blockIdx.y, chunk_rows, s.B * s.T);
  for (int64_t j = 0; j < s.W; ++j) {
    const int64_t ahead = s.W - 1 - j;
    float acc = 0.0f;
    if (ch < s.C)
      for (int64_t r = rg.r0 + threadIdx.y; r < rg.r1; r += kRowLanes)
        if (r % s.T + ahead < s.T) acc = fmaf(du[(r + ahead) * s.C + ch], x[r * ldx + ch], acc);
    sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && ch < s.C) {
      float t = sums[0][threadIdx.x];
      for (int y = 1; y < kRowLanes; ++y) t += sums[y][threadIdx.x];
      partial[(int64_t(blockIdx.y) * s.C + ch) * s.W + j] = t;
    }
    __syncthreads();
  }
}

// ---- host side ---------------------------------------------------------------------------------

template <class... P, class... A>
void launch(const char* op, void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
  kernel<<<grid, block, 0, stream()>>>(args...);
  check_launch(op);
}

unsigned grid_for(int64_t n, int threads) {
  return std::min(blocks_for(n, threads), kMaxBlocks);
}

// A gradient's sum over rows is split into ranges of consecutive rows (from the row count alone),
// each summed in order by one block into its own partial row: scratch.hpp's row_ranges.
// A block of the call's scratch (scratch.hpp's sizes: a meta run books the same).
Tensor scratch(const ScratchBlock& b) {
  return Tensor::empty({b.numel}, b.dtype, Device::cuda);
}

// out += the column sums of partial [parts, width].
void add_partials(const char* op, const float* partial, int64_t parts, int64_t width, float* out) {
  launch(op, sum_partials_kernel, dim3(blocks_for(width, kThreads)), dim3(kThreads), partial, parts,
         width, out);
}

void check_gate(const char* what, int64_t rows, int64_t width, float normalizer) {
  LOOM_CHECK(rows >= 0 && width > 0, what, ": need rows >= 0 and width > 0, got ", rows, " and ",
             width);
  LOOM_CHECK(normalizer > 0, what, ": gate normalizer must be > 0, got ", normalizer);
  LOOM_CHECK((width + kCols - 1) / kCols <= INT_MAX, what, ": width ", width,
             " is more than one launch covers");
}

void check_norm(const char* what, const GatedRmsNorm& s, const float* g, int64_t ldg) {
  LOOM_CHECK(s.rows >= 0 && s.heads > 0 && s.dim > 0, what,
             ": need rows >= 0, heads > 0 and dim > 0, got ", s.rows, ", ", s.heads, ", ", s.dim);
  LOOM_CHECK(s.eps >= 0, what, ": eps must be >= 0, got ", s.eps);
  LOOM_CHECK(!g || ldg >= s.heads * s.dim, what, ": row stride of the gate is ", ldg,
             ", expected >= ", s.heads * s.dim);
}

void check_conv(const char* what, const ShortConv& s) {
  LOOM_CHECK(s.B >= 0 && s.T >= 0 && s.C > 0 && s.W > 0, what,
             ": need B, T >= 0 and C, W > 0, got B ", s.B, " T ", s.T, " C ", s.C, " W ", s.W);
  LOOM_CHECK((s.C + kCols - 1) / kCols <= INT_MAX, what, ": C ", s.C,
             " is more than one launch covers");
}
int64_t ld_or(const char* what, const char* name, int64_t ld, int64_t C) {
  LOOM_CHECK(ld == 0 || ld >= C, what, ": row stride of ", name, " is ", ld,
             ", expected 0 (contiguous) or >= ", C);
  return ld ? ld : C;
}

}  // namespace

void gla_gate_forward(const float* z, const float* bias, int64_t rows, int64_t width,
                      float normalizer, float clamp_min, float* gk) {
  const char* op = "gla_gate_forward";
  check_gate(op, rows, width, normalizer);
  if (rows == 0) return;
  LOOM_CHECK(z && gk, op, ": null pointer among z, gk");
  const int64_t n = rows * width;
  launch(op, gate_forward_kernel, dim3(grid_for(n, kThreads)), dim3(kThreads), z, bias, n, width,
         1.0f / normalizer, clamp_min, gk);
}

void gla_gate_backward(const float* dgk, const float* z, const float* bias, int64_t rows,
                       int64_t width, float normalizer, float clamp_min, float* dz, float* dbias) {
  const char* op = "gla_gate_backward";
  check_gate(op, rows, width, normalizer);
  if (rows == 0) return;
  LOOM_CHECK(dgk && z && dz, op, ": null pointer among dgk, z, dz");
  const RowRanges c = row_ranges(rows);
  const bool sums = bias && dbias;
  // Released on return while the kernels may still run: the caching allocator hands the block out
  // again only to work queued later on the same stream (runtime.hpp).
  const std::vector<ScratchBlock> sb = gla_gate_backward_scratch(rows, width, sums);
  Tensor partial = sums ? scratch(sb[0]) : Tensor();
  float* p = sums ? partial.data<float>() : nullptr;
  launch(op, gate_backward_kernel, dim3(unsigned((width + kCols - 1) / kCols), unsigned(c.count)),
         dim3(kCols, kRowLanes), dgk, z, bias, rows, width, c.rows_per, 1.0f / normalizer,
         clamp_min, dz, p);
  if (sums) add_partials(op, p, c.count, width, dbias);
}

void gated_rmsnorm_forward(const GatedRmsNorm& s, const float* x, const float* g, int64_t ldg,
                           const float* w, float* y, float* rstd) {
  const char* op = "gated_rmsnorm_forward";
  if (ldg == 0) ldg = s.heads * s.dim;
  check_norm(op, s, g, ldg);
  if (s.rows == 0) return;
  LOOM_CHECK(x && y && rstd, op, ": null pointer among x, y, rstd");
  launch(op, grn_forward_kernel, dim3(grid_for(s.rows * s.heads, kWarps)), dim3(kThreads), s, x, g,
         ldg, w, y, rstd);
}

void gated_rmsnorm_backward(const GatedRmsNorm& s, const float* dy, const float* x, const float* g,
                            int64_t ldg, const float* w, const float* rstd, float* dx, float* dg,
                            int64_t lddg, float* dw) {
  const char* op = "gated_rmsnorm_backward";
  if (ldg == 0) ldg = s.heads * s.dim;
  if (lddg == 0) lddg = s.heads * s.dim;
  check_norm(op, s, g, ldg);
  check_norm(op, s, g ? dg : nullptr, lddg);
  if (s.rows == 0) return;
  LOOM_CHECK(dy && x && rstd && dx && (!g || dg), op,
             ": null pointer among dy, x, rstd, dx, dg (with a gate)");
  const RowRanges c = row_ranges(s.rows);
  const bool sums = w && dw;
  static_assert(kWarps == kGatedNormWarps);
  const std::vector<ScratchBlock> sb = gated_rmsnorm_backward_scratch(s.rows, s.dim, sums);
  Tensor partial = sums ? scratch(sb[0]) : Tensor();
  float* p = sums ? partial.data<float>() : nullptr;
  launch(op, grn_backward_kernel, dim3(unsigned(c.count)), dim3(kThreads), s, dy, x, g, ldg, w,
         rstd, dx, dg, lddg, c.rows_per, p);
  if (sums) add_partials(op, p, c.count * kWarps, s.dim, dw);
}

void short_conv_forward(const ShortConv& s, const float* x, int64_t ldx, const float* w, float* y,
                        int64_t ldy) {
  const char* op = "short_conv_forward";
  check_conv(op, s);
  ldx = ld_or(op, "x", ldx, s.C);
  ldy = ld_or(op, "y", ldy, s.C);
  const int64_t n = s.B * s.T * s.C;
  if (n == 0) return;
  LOOM_CHECK(x && w && y, op, ": null pointer among x, w, y");
  launch(op, conv_forward_kernel, dim3(grid_for(n, kThreads)), dim3(kThreads), s, x, ldx, w, y,
         ldy);
}

void short_conv_backward(const ShortConv& s, const float* dy, int64_t lddy, const float* x,
                         int64_t ldx, const float* w, float* dx, int64_t lddx, float* dw) {
  const char* op = "short_conv_backward";
  check_conv(op, s);
  lddy = ld_or(op, "dy", lddy, s.C);
  ldx = ld_or(op, "x", ldx, s.C);
  lddx = ld_or(op, "dx", lddx, s.C);
  const int64_t rows = s.B * s.T, n = rows * s.C;
  if (n == 0) return;
  LOOM_CHECK(dy && x && w && dx && dw, op, ": null pointer among dy, x, w, dx, dw");
  const std::vector<ScratchBlock> sb = short_conv_backward_scratch(rows, s.C, s.W);
  Tensor dubuf = scratch(sb[0]);
  float* du = dubuf.data<float>();
  launch(op, conv_du_kernel, dim3(grid_for(n, kThreads)), dim3(kThreads), s, dy, lddy, x, ldx, w,
         du);
  launch(op, conv_dx_kernel, dim3(grid_for(n, kThreads)), dim3(kThreads), s,
         static_cast<const float*>(du), w, dx, lddx);
  const RowRanges c = row_ranges(rows);
  Tensor partial = scratch(sb[1]);
  float* p = partial.data<float>();
  launch(op, conv_dw_kernel, dim3(unsigned((s.C + kCols - 1) / kCols), unsigned(c.count)),
         dim3(kCols, kRowLanes), s, static_cast<const float*>(du), x, ldx, c.rows_per, p);
  add_partials(op, p, c.count, s.C * s.W, dw);
}

}  // namespace loom::cuda
