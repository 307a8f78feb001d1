#include "kernels/cuda/rmsnorm.hpp"

#include <algorithm>
#include <climits>
#include <type_traits>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {
namespace {

// Threads of a row's block: enough for one vector each up to this many, then they loop.
constexpr int kMaxThreads = 512;
// The backward's dw: at most this many blocks, each over a fixed range of rows (chunk_rows
// consecutive rows: scratch.hpp's row_ranges, at most kRowSumRanges): the ranges depend on
// `rows` alone, so dw has the same bits on every GPU. 512 blocks of up to 512 threads fill an H100
// (132 SMs x 2048 threads) while the partials (512 x dim floats) stay small next to the inputs. The
// partials are summed by blocks of kDwCols columns x kDwGroups groups of consecutive chunks: each
// group sums its chunks in order, then the groups' sums are added in group order.
constexpr int kDwCols = 32, kDwGroups = 16;

// The sum of v over the block (blockDim.x a multiple of 32), the same bits in every thread: a
// butterfly within each warp (the two lanes of a pair add the same two values, so every lane ends
// with the same sum), then the warps' sums (zeros past the last warp) by the same butterfly. The
// order depends on blockDim.x alone. `part` is 32 shared floats; the barrier at the end lets the
// next call reuse them.
__device__ __forceinline__ float block_sum(float v, float* part) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x) / 32 ? part[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  return v;
}

// One block per row. x is read; when kRound it is first rounded to bf16 (x16 and x_round = x
// rewritten with the widened values, each element by the thread that read it), and the second
// pass reads the thread's own x16 back. Y is float or uint16_t (bf16 bits). Every element with
// the CPU's expressions: ss of x*x, rs = 1/sqrt(ss*inv_dim + eps), y = (x*rs)*w.
template <int N, bool kRound, class Y>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_forward_kernel(const float* x, float* x_round, uint16_t* x16,
                           const float* __restrict__ w, int64_t dim, float inv_dim, float eps,
                           Y* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float part[32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  Y* yr = y + r * dim;
  const int64_t first = int64_t(threadIdx.x) * N, step = int64_t(blockDim.x) * N;
  float ss = 0.0f;
  for (int64_t i = first; i < dim; i += step) {
    float v[N];
    load(xr + i, v);
    if constexpr (kRound) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = bf16_bits_to_f32(f32_to_bf16_bits(v[k]));
      store(x16 + r * dim + i, v);  // a value bf16 holds rounds to its own bits
      store(x_round + r * dim + i, v);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) ss = fmaf(v[k], v[k], ss);
  }
  // fmaf written out: the same rounding in every variant, whatever nvcc would fuse.
  const float rs = 1.0f / sqrtf(fmaf(block_sum(ss, part), inv_dim, eps));
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int64_t i = first; i < dim; i += step) {
    float v[N], wv[N], o[N];
    if constexpr (kRound)
      load(static_cast<const uint16_t*>(x16 + r * dim + i), v);
    else
      load(xr + i, v);
    load(w + i, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = v[k] * rs * wv[k];
    store(yr + i, o);
  }
}

// Block c owns rows [c*chunk_rows, min(rows, (c+1)*chunk_rows)) and partial row c: per row, the
// dot sum(dy*w*x) over the block, then dx += rs*(dy*w - x*k) with k = dot*rs*rs*inv_dim, and
// partial = (first row of the chunk ? 0 : partial) + dy*x*rs. Each thread reads and writes only
// its own elements of dx and of the partial row, so no barrier guards them. The FMAs are written
// out (fmaf, __fmul_rn) so that both kinds of x get the same roundings, whatever nvcc would fuse.
template <int N, class X>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_backward_kernel(const float* __restrict__ dy, const X* __restrict__ x,
                            const float* __restrict__ w, const float* __restrict__ rstd,
                            int64_t rows, int64_t dim, int64_t chunk_rows, float inv_dim,
                            float* __restrict__ dx, float* __restrict__ partial) {
  __shared__ float part[32];
  const int64_t r0 = int64_t(blockIdx.x) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float* pw = partial + int64_t(blockIdx.x) * dim;
  const int64_t first = int64_t(threadIdx.x) * N, step = int64_t(blockDim.x) * N;
  for (int64_t r = r0; r < r1; ++r) {
    const float* dyr = dy + r * dim;
    const X* xr = x + r * dim;
    float* dxr = dx + r * dim;
    const float rs = rstd[r];
    float dot = 0.0f;
    for (int64_t i = first; i < dim; i += step) {
      float dv[N], wv[N], xv[N];
      load(dyr + i, dv);
      load(w + i, wv);
      load(xr + i, xv);
#pragma unroll
      for (int k = 0; k < N; ++k) dot = fmaf(__fmul_rn(dv[k], wv[k]), xv[k], dot);
    }
    const float kk = block_sum(dot, part) * rs * rs * inv_dim;
    for (int64_t i = first; i < dim; i += step) {
      float dv[N], wv[N], xv[N], g[N], p[N];
      load(dyr + i, dv);
      load(w + i, wv);
      load(xr + i, xv);
      load(dxr + i, g);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        g[k] = fmaf(rs, fmaf(-xv[k], kk, __fmul_rn(dv[k], wv[k])), g[k]);
        p[k] = dv[k] * xv[k] * rs;
      }
      store(dxr + i, g);
      if (r != r0) {
        float q[N];
        load(pw + i, q);
#pragma unroll
        for (int k = 0; k < N; ++k) p[k] = q[k] + p[k];
      }
      store(pw + i, p);
    }
  }
}

// dw[j] += the sum of partial[c][j] over c: group g (threadIdx.y) sums chunks [g*per_group,
// (g+1)*per_group) in order, then the groups' sums are added in group order. The order depends on
// the chunk count alone.
__global__ void __launch_bounds__(kDwCols* kDwGroups)
    rmsnorm_dw_kernel(const float* __restrict__ partial, int64_t chunks, int64_t per_group,
                      int64_t dim, float* __restrict__ dw) {
  __shared__ float sums[kDwGroups][kDwCols];
  const int64_t j = int64_t(blockIdx.x) * kDwCols + threadIdx.x;
  const int64_t c0 = int64_t(threadIdx.y) * per_group;
  const int64_t c1 = c0 + per_group < chunks ? c0 + per_group : chunks;
  float acc = 0.0f;
  if (j < dim && c0 < c1) {
    acc = partial[c0 * dim + j];
#pragma unroll 8
    for (int64_t c = c0 + 1; c < c1; ++c) acc += partial[c * dim + j];
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < dim) {
    float total = sums[0][threadIdx.x];
    for (int g = 1; g < kDwGroups && g * per_group < chunks; ++g) total += sums[g][threadIdx.x];
    dw[j] += total;
  }
}

int threads_for(int64_t vectors) {
  return int(std::clamp<int64_t>((vectors + 31) / 32 * 32, 32, kMaxThreads));
}

void check_args(const char* what, int64_t rows, int64_t dim) {
  LOOM_CHECK(rows >= 0, what, ": rows must be >= 0, got ", rows);
  LOOM_CHECK(dim > 0, what, ": dim must be > 0, got ", dim);
  LOOM_CHECK(rows <= INT_MAX, what, ": ", rows, " rows, more than one launch covers (", INT_MAX,
             ")");
}

template <int N, bool kRound, class Y>
void launch_forward(const char* op, const float* x, float* x_round, uint16_t* x16, const float* w,
                    int64_t rows, int64_t dim, float eps, Y* y, float* rstd) {
  const int threads = threads_for((dim + N - 1) / N);
  rmsnorm_forward_kernel<N, kRound, Y><<<unsigned(rows), threads, 0, stream()>>>(
      x, x_round, x16, w, dim, 1.0f / float(dim), eps, y, rstd);
  check_launch(op);
}

// The vector width of a row's accesses, chosen from dim alone wherever the pointers are aligned
// as the allocator hands them out, so that the f32 and bf16 variants of a kernel split a row the
// same way and sum it in the same order: then the bf16 y is the f32 y rounded, and the bf16-x
// backward has the f32-x backward's bits on the widened copy (the CPU's contracts). 8 elements
// (16-byte accesses; two for floats) where dim % 8 == 0 and every array is 16-byte aligned; 4
// (16 bytes of floats, 8 of bf16) where dim % 4 == 0 and the f32 arrays are 16-byte aligned and
// the bf16 ones 8-byte aligned; 1 otherwise.
bool aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}
template <class T>
uintptr_t vector_bytes(int n) {
  return uintptr_t(n) * sizeof(T) < 16 ? uintptr_t(n) * sizeof(T) : 16;
}
template <class A, class B, class C, class D>
int width_for(int64_t dim, const A* a, const B* b, const C* c, const D* d) {
  for (const int n : {8, 4})
    if (dim % n == 0 && aligned(a, vector_bytes<A>(n)) && aligned(b, vector_bytes<B>(n)) &&
        aligned(c, vector_bytes<C>(n)) && aligned(d, vector_bytes<D>(n)))
      return n;
  return 1;
}

template <bool kRound, class Y>
void forward(const char* op, const float* x, float* x_round, uint16_t* x16, const float* w,
             int64_t rows, int64_t dim, float eps, Y* y, float* rstd) {
  check_args(op, rows, dim);
  LOOM_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  if (rows == 0) return;
  // Without x16 (a plain forward) its place is taken by x, which is checked anyway.
  const int n = kRound ? width_for(dim, x, w, y, x16) : width_for(dim, x, w, y, x);
  if (n == 8)
    launch_forward<8, kRound>(op, x, x_round, x16, w, rows, dim, eps, y, rstd);
  else if (n == 4)
    launch_forward<4, kRound>(op, x, x_round, x16, w, rows, dim, eps, y, rstd);
  else
    launch_forward<1, kRound>(op, x, x_round, x16, w, rows, dim, eps, y, rstd);
}

template <int N, class X>
void launch_backward(const float* dy, const X* x, const float* w, const float* rstd, int64_t rows,
                     int64_t dim, float* dx, float* dw) {
  const RowRanges r = row_ranges(rows);  // rmsnorm_backward_scratch's
  const int64_t chunk_rows = r.rows_per, chunks = r.count;
  // Released when this returns, while the kernels may still run: the caching allocator hands the
  // block out again only to work queued later on the same stream (runtime.hpp).
  Tensor partial = Tensor::empty({chunks, dim}, DType::f32, Device::cuda);
  float* p = partial.data<float>();
  rmsnorm_backward_kernel<N, X><<<unsigned(chunks), threads_for((dim + N - 1) / N), 0, stream()>>>(
      dy, x, w, rstd, rows, dim, chunk_rows, 1.0f / float(dim), dx, p);
  check_launch("rmsnorm_backward");
  const int64_t per_group = (chunks + kDwGroups - 1) / kDwGroups;
  rmsnorm_dw_kernel<<<blocks_for(dim, kDwCols), dim3(kDwCols, kDwGroups), 0, stream()>>>(
      p, chunks, per_group, dim, dw);
  check_launch("rmsnorm_backward");
}

template <class X>
void backward(const float* dy, const X* x, const float* w, const float* rstd, int64_t rows,
              int64_t dim, float* dx, float* dw) {
  check_args("rmsnorm_backward", rows, dim);
  if (rows == 0) return;
  const int n = width_for(dim, dy, x, w, dx);
  if (n == 8)
    launch_backward<8>(dy, x, w, rstd, rows, dim, dx, dw);
  else if (n == 4)
    launch_backward<4>(dy, x, w, rstd, rows, dim, dx, dw);
  else
    launch_backward<1>(dy, x, w, rstd, rows, dim, dx, dw);
}

uint16_t* bits(bf16* p) {
  return reinterpret_cast<uint16_t*>(p);
}
const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y,
                     float* rstd) {
  forward<false>("rmsnorm_forward", x, nullptr, nullptr, w, rows, dim, eps, y, rstd);
}

void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t dim, float eps, bf16* y,
                     float* rstd) {
  forward<false>("rmsnorm_forward", x, nullptr, nullptr, w, rows, dim, eps, bits(y), rstd);
}

void rmsnorm_forward_rounding_input(float* x, bf16* x16, const float* w, int64_t rows, int64_t dim,
                                    float eps, bf16* y, float* rstd) {
  LOOM_CHECK(x16, "rmsnorm_forward_rounding_input: x16 is null");
  forward<true>("rmsnorm_forward_rounding_input", x, x, bits(x16), w, rows, dim, eps, bits(y),
                rstd);
}

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw) {
  backward(dy, x, w, rstd, rows, dim, dx, dw);
}

void rmsnorm_backward(const float* dy, const bf16* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw) {
  backward(dy, bits(x), w, rstd, rows, dim, dx, dw);
}

}  // namespace loom::cuda
