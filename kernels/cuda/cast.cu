#include "kernels/cuda/cast.hpp"

#include "core/error.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {

namespace {

constexpr int kThreads = 256;

// 8 elements a thread with 16-byte accesses on the bf16 side (two float4 on the f32 side); the
// grid strides, so any n runs with a grid that fills the GPU once.
__global__ void f32_to_bf16_vec(const float4* __restrict in, uint4* __restrict out, int64_t n8) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a = in[2 * i], b = in[2 * i + 1];
    out[i] = make_uint4(pack2(a.x, a.y), pack2(a.z, a.w), pack2(b.x, b.y), pack2(b.z, b.w));
  }
}
__global__ void bf16_to_f32_vec(const uint4* __restrict in, float4* __restrict out, int64_t n8) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 w = in[i];
    out[2 * i] = make_float4(lo_of(w.x), hi_of(w.x), lo_of(w.y), hi_of(w.y));
    out[2 * i + 1] = make_float4(lo_of(w.z), hi_of(w.z), lo_of(w.w), hi_of(w.w));
  }
}
// The scalar forms: unaligned pointers and the last n % 8 elements.
__global__ void f32_to_bf16_scalar(const float* __restrict in, uint16_t* __restrict out,
                                   int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = f32_to_bf16_bits(in[i]);
}
__global__ void bf16_to_f32_scalar(const uint16_t* __restrict in, float* __restrict out,
                                   int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = bf16_bits_to_f32(in[i]);
}
__global__ void fill_kernel(float* __restrict x, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = value;
}
__global__ void scale_kernel(float* __restrict x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}
__global__ void add_kernel(float* __restrict y, const float* __restrict x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

// sum_squares: blocks of kSumSquaresChunk elements (scratch.hpp) each give one partial (a fixed
// tree inside the block), then one block sums the partials in a fixed tree: the order depends on n
// alone.
__device__ double block_sum(double v, double* shared) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;  // the sum, in thread 0
}
__global__ void sum_squares_partial(const float* __restrict x, int64_t n,
                                    double* __restrict partial) {
  __shared__ double shared[32];
  const int64_t lo = blockIdx.x * kSumSquaresChunk, hi = min(n, lo + kSumSquaresChunk);
  double s = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) s += double(x[i]) * double(x[i]);
  s = block_sum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void sum_partials(const double* __restrict partial, int64_t n, double* __restrict out) {
  __shared__ double shared[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *out = s;
}

// A grid that covers n items once, capped where the grid-stride loop takes over (about 16
// resident blocks of 256 threads on each of 132 SMs).
unsigned grid_for(int64_t n) {
  const unsigned b = blocks_for(n, kThreads);
  return b < 2048u ? b : 2048u;
}

}  // namespace

void cast_f32_to_bf16(const float* in, bf16* out, int64_t n) {
  if (n <= 0) return;
  auto* o = reinterpret_cast<uint16_t*>(out);
  int64_t done = 0;
  if (aligned16(in) && aligned16(out)) {
    const int64_t n8 = n / 8;
    if (n8 > 0) {
      f32_to_bf16_vec<<<grid_for(n8), kThreads, 0, stream()>>>(reinterpret_cast<const float4*>(in),
                                                               reinterpret_cast<uint4*>(o), n8);
      check_launch("cast_f32_to_bf16");
    }
    done = n8 * 8;
  }
  if (done < n) {
    f32_to_bf16_scalar<<<grid_for(n - done), kThreads, 0, stream()>>>(in + done, o + done,
                                                                      n - done);
    check_launch("cast_f32_to_bf16");
  }
}

void cast_bf16_to_f32(const bf16* in, float* out, int64_t n) {
  if (n <= 0) return;
  const auto* i16 = reinterpret_cast<const uint16_t*>(in);
  int64_t done = 0;
  if (aligned16(in) && aligned16(out)) {
    const int64_t n8 = n / 8;
    if (n8 > 0) {
      bf16_to_f32_vec<<<grid_for(n8), kThreads, 0, stream()>>>(reinterpret_cast<const uint4*>(i16),
                                                               reinterpret_cast<float4*>(out), n8);
      check_launch("cast_bf16_to_f32");
    }
    done = n8 * 8;
  }
  if (done < n) {
    bf16_to_f32_scalar<<<grid_for(n - done), kThreads, 0, stream()>>>(i16 + done, out + done,
                                                                      n - done);
    check_launch("cast_bf16_to_f32");
  }
}

void fill(float* x, int64_t n, float value) {
  if (n <= 0) return;
  fill_kernel<<<grid_for(n), kThreads, 0, stream()>>>(x, n, value);
  check_launch("fill");
}

void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
               int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  LOOM_CUDA_CHECK(
      cudaMemcpy2DAsync(dst, size_t(dst_stride) * 4, src, size_t(src_stride) * 4, size_t(cols) * 4,
                        size_t(rows), cudaMemcpyDeviceToDevice, stream()),
      "copy_rows");
}

void scale_inplace(float* x, int64_t n, float s) {
  if (n <= 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream()>>>(x, n, s);
  check_launch("scale_inplace");
}

void add_inplace(float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream()>>>(y, x, n);
  check_launch("add_inplace");
}

void sum_squares(const float* x, int64_t n, double* scratch, double* out) {
  LOOM_CHECK(n >= 0, "sum_squares: n must be >= 0, got ", n);
  const int64_t parts = sum_squares_parts(n);
  if (n == 0) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream()), "sum_squares");
    return;
  }
  sum_squares_partial<<<unsigned(parts), kThreads, 0, stream()>>>(x, n, scratch);
  check_launch("sum_squares");
  sum_partials<<<1, 1024, 0, stream()>>>(scratch, parts, out);
  check_launch("sum_squares");
}

}  // namespace loom::cuda
