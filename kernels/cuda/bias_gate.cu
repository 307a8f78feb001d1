#include "kernels/cuda/bias_gate.hpp"

#include <algorithm>
#include <climits>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/moe_rows.cuh"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Blocks of the row and element-wise kernels: at most this many (grid-stride loops beyond).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
// The column sums: ranges of consecutive rows (kernels/cuda/scratch.hpp's row_ranges, at least
// kBiasMinRangeRows long; bounds from the row count alone), each summed by one block column into
// its own partial.
// A partial's block: 32 columns x 8 row lanes (lane y takes rows y, y + 8, ... of the range; the
// lanes' sums are then added in lane order).
constexpr int kCols = 32, kRowLanes = 8;

unsigned capped_blocks(int64_t items, int per_block) {
  return unsigned(std::clamp<int64_t>((items + per_block - 1) / per_block, 1, kMaxBlocks));
}

// ---- the bias ----------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    add_bias_kernel(float* __restrict__ y, int64_t M, int64_t N, int64_t ldy,
                    const float* __restrict__ b) {
  const int64_t n = M * N, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t m = e / N, c = e % N;
    y[m * ldy + c] = __fadd_rn(y[m * ldy + c], b[c]);
  }
}

// partial[range, j] = the sum in double of dy[r, j] over the rows r of range blockIdx.y, for the
// block's 32 columns: each row lane its rows in order, then the lanes in order.
__global__ void __launch_bounds__(kCols* kRowLanes)
    column_partials_kernel(const float* __restrict__ dy, int64_t M, int64_t N, int64_t ld,
                           int64_t range_rows, double* __restrict__ partial) {
  __shared__ double sums[kRowLanes][kCols];
  const int64_t j = int64_t(blockIdx.x) * kCols + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * range_rows,
                r1 = r0 + range_rows < M ? r0 + range_rows : M;
  double acc = 0.0;
  if (j < N)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes)
      acc = __dadd_rn(acc, double(dy[r * ld + j]));
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < N) {
    double t = sums[0][threadIdx.x];
    for (int y = 1; y < kRowLanes; ++y) t = __dadd_rn(t, sums[y][threadIdx.x]);
    partial[int64_t(blockIdx.y) * N + j] = t;
  }
}

// db[j] = f32(db[j] + the partials of column j added in range order).
__global__ void __launch_bounds__(kThreads)
    column_total_kernel(const double* __restrict__ partial, int64_t ranges, int64_t N,
                        float* __restrict__ db) {
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= N) return;
  double t = partial[j];
  for (int64_t p = 1; p < ranges; ++p) t = __dadd_rn(t, partial[p * N + j]);
  db[j] = float(__dadd_rn(double(db[j]), t));
}

// ---- the shared expert's gate ------------------------------------------------------------------

// Row t = blockIdx.x (grid-stride): y[t, c] = y + s_t ys[t, c], the product rounded, then added.
template <class Y>
__global__ void __launch_bounds__(kThreads)
    gate_forward_kernel(const float* __restrict__ z, const Y* __restrict__ ys, int64_t M, int64_t d,
                        float* __restrict__ y) {
  for (int64_t t = blockIdx.x; t < M; t += gridDim.x) {
    const float s = sigmoid_f32(z[t]);
    const Y* r = ys + t * d;
    float* out = y + t * d;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
      out[c] = __fadd_rn(out[c], __fmul_rn(s, widen(r[c])));
  }
}

// One warp per row: dys = s dy, dz = (dy . ys) s (1 - s) with the slope in double as the CPU's:
// e / (1 + e)^2, e = e^-|z|.
template <class Y, class D>
__global__ void __launch_bounds__(kThreads)
    gate_backward_kernel(const float* __restrict__ dy, const float* __restrict__ z,
                         const Y* __restrict__ ys, int64_t M, int64_t d, D* __restrict__ dys,
                         float* __restrict__ dz) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < M; t += step) {
    const float zt = z[t];
    const double dot =
        scaled_copy_dot(dy + t * d, ys + t * d, d, sigmoid_f32(zt), dys + t * d, lane);
    if (lane == 0) {
      const double e = exp(-fabs(double(zt))), e1 = __dadd_rn(1.0, e);
      dz[t] = float(__dmul_rn(dot, __ddiv_rn(e, __dmul_rn(e1, e1))));
    }
  }
}

void check_matrix(const char* what, int64_t M, int64_t N, int64_t ld) {
  LOOM_CHECK(M >= 0, what, ": row count M must be >= 0, got ", M);
  LOOM_CHECK(N > 0, what, ": row width must be > 0, got ", N);
  LOOM_CHECK(ld >= N, what, ": row stride ", ld, " is below the row width ", N);
}

uint16_t* bits(bf16* p) {
  return reinterpret_cast<uint16_t*>(p);
}
const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

template <class Y>
void gate_forward(const float* z, const Y* ys, int64_t M, int64_t d, float* y) {
  const char* what = "sigmoid_gate_forward";
  check_matrix(what, M, d, d);
  if (M == 0) return;
  const int threads = int(std::min<int64_t>((d + 31) / 32 * 32, kThreads));
  gate_forward_kernel<<<unsigned(std::min(M, kMaxBlocks)), threads, 0, stream()>>>(z, ys, M, d, y);
  check_launch(what);
}

template <class Y, class D>
void gate_backward(const float* dy, const float* z, const Y* ys, int64_t M, int64_t d, D* dys,
                   float* dz) {
  const char* what = "sigmoid_gate_backward";
  check_matrix(what, M, d, d);
  if (M == 0) return;
  gate_backward_kernel<<<capped_blocks(M, kWarps), kThreads, 0, stream()>>>(dy, z, ys, M, d, dys,
                                                                            dz);
  check_launch(what);
}

}  // namespace

void add_bias(float* y, int64_t M, int64_t N, int64_t ldy, const float* b) {
  check_matrix("add_bias", M, N, ldy);
  if (M == 0) return;
  add_bias_kernel<<<capped_blocks(M * N, kThreads), kThreads, 0, stream()>>>(y, M, N, ldy, b);
  check_launch("add_bias");
}

void bias_grad(const float* dy, int64_t M, int64_t N, int64_t lddy, float* db) {
  const char* what = "bias_grad";
  check_matrix(what, M, N, lddy);
  if (M == 0) return;  // nothing to add (db + 0 would turn a -0 into +0)
  const RowRanges r = row_ranges(M, kBiasMinRangeRows);
  const int64_t range_rows = r.rows_per, ranges = r.count;
  const int64_t col_blocks = (N + kCols - 1) / kCols;
  LOOM_CHECK(col_blocks <= INT_MAX, what, ": ", N, " columns, more than one launch covers");
  // Released when this returns: the caching allocator hands the block out again only to work
  // queued later on the same stream (runtime.hpp). Two f32 elements per double.
  const ScratchBlock sb = bias_grad_scratch(M, N)[0];  // 2 * ranges * N
  Tensor partial = Tensor::empty({sb.numel}, sb.dtype, Device::cuda);
  auto* p = static_cast<double*>(partial.raw());
  column_partials_kernel<<<dim3(unsigned(col_blocks), unsigned(ranges)), dim3(kCols, kRowLanes), 0,
                           stream()>>>(dy, M, N, lddy, range_rows, p);
  check_launch(what);
  column_total_kernel<<<blocks_for(N, kThreads), kThreads, 0, stream()>>>(p, ranges, N, db);
  check_launch(what);
}

void sigmoid_gate_forward(const float* z, const float* ys, int64_t M, int64_t d, float* y) {
  gate_forward(z, ys, M, d, y);
}
void sigmoid_gate_forward(const float* z, const bf16* ys, int64_t M, int64_t d, float* y) {
  gate_forward(z, bits(ys), M, d, y);
}

void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           float* dys, float* dz) {
  gate_backward(dy, z, ys, M, d, dys, dz);
}
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           float* dys, float* dz) {
  gate_backward(dy, z, bits(ys), M, d, dys, dz);
}
void sigmoid_gate_backward(const float* dy, const float* z, const float* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz) {
  gate_backward(dy, z, ys, M, d, bits(dys), dz);
}
void sigmoid_gate_backward(const float* dy, const float* z, const bf16* ys, int64_t M, int64_t d,
                           bf16* dys, float* dz) {
  gate_backward(dy, z, bits(ys), M, d, bits(dys), dz);
}

}  // namespace loom::cuda
