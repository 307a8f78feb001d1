#include "kernels/cuda/swiglu.hpp"

#include <algorithm>
#include <type_traits>

#include "core/error.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {
namespace {

// Threads of a block: each takes N consecutive columns of one row per step; blockIdx.y walks the
// rows (grid-stride past 65535 rows).
constexpr int kThreads = 256;
constexpr unsigned kMaxGridY = 65535;

// The CPU's expressions (kernels/cpu/swiglu.cpp), IEEE division and CUDA's expf (no fast math).
// The sums are written out (__fadd_rn, fmaf) so that nvcc cannot fuse them differently in the f32
// and bf16 variants: the bf16 outputs are the f32 outputs rounded, bit for bit.
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / __fadd_rn(1.0f, expf(-x));
}

// h[r, j..j+N) from gate gu[r, j..] and up gu[r, F + j..]; In and Out are float or uint16_t
// (bf16 bits). N > 1 needs F % N == 0 and 16-byte aligned rows.
template <int N, class In, class Out>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const In* __restrict__ gu, int64_t rows, int64_t F, Out* __restrict__ h) {
  const int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (j >= F) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const In* g = gu + r * 2 * F + j;
    float gv[N], uv[N], o[N];
    load(g, gv);
    load(g + F, uv);
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = gv[k] * sigmoid(gv[k]) * uv[k];
    store(h + r * F + j, o);
  }
}

// gu and dgu may be the same array (no __restrict__ on them, and no read-only cache path for gu):
// each thread loads its gate, up and dh elements into registers before it stores the gradients to
// the same positions, and no other thread touches them.
template <int N, class T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const float* __restrict__ dh, const T* gu, int64_t rows, int64_t F,
                           T* dgu) {
  const int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (j >= F) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* g = gu + r * 2 * F + j;
    T* dg = dgu + r * 2 * F + j;
    float gv[N], uv[N], dv[N], og[N], ou[N];
    load(g, gv);
    load(g + F, uv);
    load(dh + r * F + j, dv);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float s = sigmoid(gv[k]);
      og[k] = dv[k] * uv[k] * s * fmaf(gv[k], 1.0f - s, 1.0f);
      ou[k] = dv[k] * gv[k] * s;
    }
    store(dg, og);
    store(dg + F, ou);
  }
}

void check_args(const char* what, int64_t rows, int64_t F) {
  LOOM_CHECK(rows >= 0, what, ": rows must be >= 0, got ", rows);
  LOOM_CHECK(F > 0, what, ": F (hidden size of the MLP) must be > 0, got ", F);
}

// Threads and blocks covering ceil(F / N) column vectors by the rows.
struct Grid {
  dim3 blocks;
  int threads;
};
Grid grid_for(int64_t rows, int64_t F, int N) {
  const int64_t vectors = (F + N - 1) / N;
  const int threads = int(std::min<int64_t>((vectors + 31) / 32 * 32, kThreads));
  return {dim3(blocks_for(vectors, threads), unsigned(std::min<int64_t>(rows, kMaxGridY))),
          threads};
}

template <int N, class In, class Out>
void launch_forward(const In* gu, int64_t rows, int64_t F, Out* h) {
  const Grid g = grid_for(rows, F, N);
  swiglu_forward_kernel<N><<<g.blocks, g.threads, 0, stream()>>>(gu, rows, F, h);
  check_launch("swiglu_forward");
}

// 16-byte accesses where every row starts 16-byte aligned: aligned bases and F a multiple of the
// vector (4 floats; 8 elements where a bf16 array takes part); element by element otherwise.
template <class In, class Out>
void forward(const In* gu, int64_t rows, int64_t F, Out* h) {
  check_args("swiglu_forward", rows, F);
  if (rows == 0) return;
  constexpr int V = std::is_same_v<In, float> && std::is_same_v<Out, float> ? 4 : 8;
  if (F % V == 0 && aligned16(gu) && aligned16(h))
    launch_forward<V>(gu, rows, F, h);
  else
    launch_forward<1>(gu, rows, F, h);
}

template <int N, class T>
void launch_backward(const float* dh, const T* gu, int64_t rows, int64_t F, T* dgu) {
  const Grid g = grid_for(rows, F, N);
  swiglu_backward_kernel<N><<<g.blocks, g.threads, 0, stream()>>>(dh, gu, rows, F, dgu);
  check_launch("swiglu_backward");
}

template <class T>
void backward(const float* dh, const T* gu, int64_t rows, int64_t F, T* dgu) {
  check_args("swiglu_backward", rows, F);
  if (rows == 0) return;
  constexpr int V = std::is_same_v<T, float> ? 4 : 8;
  if (F % V == 0 && aligned16(dh) && aligned16(gu) && aligned16(dgu))
    launch_backward<V>(dh, gu, rows, F, dgu);
  else
    launch_backward<1>(dh, gu, rows, F, dgu);
}

uint16_t* bits(bf16* p) {
  return reinterpret_cast<uint16_t*>(p);
}
const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

}  // namespace

void swiglu_forward(const float* gu, int64_t rows, int64_t F, float* h) {
  forward(gu, rows, F, h);
}

void swiglu_forward(const float* gu, int64_t rows, int64_t F, bf16* h) {
  forward(gu, rows, F, bits(h));
}

void swiglu_forward(const bf16* gu, int64_t rows, int64_t F, bf16* h) {
  forward(bits(gu), rows, F, bits(h));
}

void swiglu_backward(const float* dh, const float* gu, int64_t rows, int64_t F, float* dgu) {
  backward(dh, gu, rows, F, dgu);
}

void swiglu_backward(const float* dh, const bf16* gu, int64_t rows, int64_t F, bf16* dgu) {
  backward(dh, bits(gu), rows, F, bits(dgu));
}

}  // namespace loom::cuda
