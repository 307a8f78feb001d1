#include "kernels/cuda/attention_decode.hpp"

#include <climits>
#include <cmath>

#include "core/error.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"

namespace loom::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;  // scores in base 2, as the CPU kernel
constexpr int kThreads = 128;                  // 4 warps per (query, head)
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;  // keys whose scores sit in shared memory at once
// Output dims per thread: D <= kThreads * kDims.
constexpr int kDims = int(kDecodeMaxHeadDim) / kThreads;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The block's max or sum of one value per thread, the same bits in every thread (`part`: kWarps
// shared floats; the barrier at the end lets the next call reuse them).
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* part) {
  v = kMax ? warp_max(v) : warp_sum(v);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float r = part[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, part[w]) : r + part[w];
  __syncthreads();
  return r;
}

// blockIdx.x = query i * Hq + head h.
__global__ void decode_kernel(DecodeShape s, const float* q, const float* k, const float* v,
                              float* out) {
  __shared__ float qs[kDecodeMaxHeadDim];
  __shared__ float sc[kChunk];
  __shared__ float part[kWarps];
  const int64_t i = int64_t(blockIdx.x) / s.Hq, h = int64_t(blockIdx.x) % s.Hq;
  const int64_t g = h / (s.Hq / s.Hkv), D = s.D;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const float c = s.scale * kLog2e;
  for (int64_t d = tid; d < D; d += kThreads) qs[d] = q[i * s.q_stride + h * D + d];
  __syncthreads();
  const float* kb = k + g * D;
  const float* vb = v + g * D;
  const int64_t n = s.L - s.Tq + i + 1;  // keys this query sees
  float acc[kDims];
#pragma unroll
  for (int e = 0; e < kDims; ++e) acc[e] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int nj = int(n - j0 < kChunk ? n - j0 : kChunk);
    // Scores: warp w takes keys w, w + kWarps, ...; its lanes split the head dim.
    for (int j = warp; j < nj; j += kWarps) {
      const float* kj = kb + (j0 + j) * s.kv_stride;
      float dot = 0.0f;
      for (int64_t d = lane; d < D; d += 32) dot += qs[d] * kj[d];
      dot = warp_sum(dot);
      if (lane == 0) sc[j] = dot * c;
    }
    __syncthreads();
    float mine = -INFINITY;
    for (int j = tid; j < nj; j += kThreads) mine = fmaxf(mine, sc[j]);
    const float m_new = fmaxf(m, block_reduce<true>(mine, part));
    const float alpha = exp2f(m - m_new);  // 0 on the first chunk (m = -inf)
    float psum = 0.0f;
    for (int j = tid; j < nj; j += kThreads) {
      const float p = exp2f(sc[j] - m_new);
      sc[j] = p;
      psum += p;
    }
    l = l * alpha + block_reduce<false>(psum, part);  // its barrier publishes sc's p
    m = m_new;
#pragma unroll
    for (int e = 0; e < kDims; ++e) {
      const int64_t d = tid + int64_t(e) * kThreads;
      if (d >= D) break;
      float a = acc[e] * alpha;
      for (int j = 0; j < nj; ++j) a += sc[j] * vb[(j0 + j) * s.kv_stride + d];
      acc[e] = a;
    }
    __syncthreads();  // sc is rewritten by the next chunk
  }
  float* o = out + i * s.Hq * D + h * D;
#pragma unroll
  for (int e = 0; e < kDims; ++e) {
    const int64_t d = tid + int64_t(e) * kThreads;
    if (d >= D) break;
    o[d] = acc[e] / l;
  }
}

}  // namespace

void attention_decode(const DecodeShape& s, const float* q, const float* k, const float* v,
                      float* out) {
  const char* op = "attention_decode";
  LOOM_CHECK(s.Tq > 0 && s.L >= s.Tq && s.Hq > 0 && s.Hkv > 0 && s.D > 0, op,
             ": Tq, Hq, Hkv, D must be positive and L >= Tq, got Tq=", s.Tq, " L=", s.L,
             " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
  LOOM_CHECK(s.Hq % s.Hkv == 0, op, ": Hq (", s.Hq, ") must be a multiple of Hkv (", s.Hkv, ")");
  LOOM_CHECK(s.D <= kDecodeMaxHeadDim, op, ": head dim ", s.D, " > ", kDecodeMaxHeadDim,
             ", the most the kernel takes");
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, op, ": q_stride ", s.q_stride, " < Hq*D = ", s.Hq * s.D);
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, op, ": kv_stride ", s.kv_stride,
             " < Hkv*D = ", s.Hkv * s.D);
  LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0, op, ": scale must be finite and > 0, got ",
             s.scale);
  LOOM_CHECK(s.Tq * s.Hq <= INT_MAX, op, ": Tq*Hq = ", s.Tq * s.Hq,
             ", more blocks than one launch covers");
  LOOM_CHECK(q && k && v && out, op, ": null pointer among q, k, v, out");
  decode_kernel<<<unsigned(s.Tq * s.Hq), kThreads, 0, stream()>>>(s, q, k, v, out);
  check_launch(op);
}

}  // namespace loom::cuda
