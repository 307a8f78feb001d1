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

// N consecutive elements at p, widened to float: N = 1 (any alignment), or N = 4 / 8 (p aligned
// to N elements: 16-byte accesses, 8 bytes for 4 bf16).
template <int N>
__device__ __forceinline__ void load(const float* p, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float4 q = reinterpret_cast<const float4*>(p)[k];
      v[4 * k] = q.x;
      v[4 * k + 1] = q.y;
      v[4 * k + 2] = q.z;
      v[4 * k + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = p[k];
  }
}
template <int N>
__device__ __forceinline__ void load(const uint16_t* p, float (&v)[N]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int k = 0; k < N / 8; ++k) {
      const uint4 q = reinterpret_cast<const uint4*>(p)[k];
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[8 * k + 2 * e] = lo_of(w[e]);
        v[8 * k + 2 * e + 1] = hi_of(w[e]);
      }
    }
  } else if constexpr (N == 4) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    v[0] = lo_of(q.x);
    v[1] = hi_of(q.x);
    v[2] = lo_of(q.y);
    v[3] = hi_of(q.y);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = bf16_bits_to_f32(p[k]);
  }
}
// Stores N floats, or N bf16 rounded by f32_to_bf16_bits (the CPU's float_to_bf16).
template <int N>
__device__ __forceinline__ void store(float* p, const float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k)
      reinterpret_cast<float4*>(p)[k] =
          make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = v[k];
  }
}
template <int N>
__device__ __forceinline__ void store(uint16_t* p, const float (&v)[N]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int k = 0; k < N / 8; ++k)
      reinterpret_cast<uint4*>(p)[k] =
          make_uint4(pack2(v[8 * k], v[8 * k + 1]), pack2(v[8 * k + 2], v[8 * k + 3]),
                     pack2(v[8 * k + 4], v[8 * k + 5]), pack2(v[8 * k + 6], v[8 * k + 7]));
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2(v[0], v[1]), pack2(v[2], v[3]));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = f32_to_bf16_bits(v[k]);
  }
}

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
