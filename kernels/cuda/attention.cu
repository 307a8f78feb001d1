#include "kernels/cuda/attention.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/cast.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/flash_attention.hpp"
#include "kernels/cuda/gemm.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {
namespace {

// The constants of kernels/cpu/vec_math-inl.hpp (scores in base 2).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

// Threads of a row's block in the row kernels (one block per query row of S): enough for one key
// each up to this many, then they loop.
constexpr int kMaxRowThreads = 256;
// Rows per block of the one-warp-per-row kernels (delta, merge).
constexpr int kWarpRows = 8;
// The element-wise output pass: threads per block, and at most this many blocks (a grid-stride
// loop beyond).
constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 1u << 20;

// ---- device helpers ----------------------------------------------------------------------------

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// op over the block (blockDim.x a multiple of 32), the same bits in every thread: a butterfly
// within each warp (both lanes of a pair combine the same two values), then the warps' results
// (`identity` past the last warp) by the same butterfly. The order depends on blockDim.x alone.
// `part` is 32 shared floats; the barrier at the end lets the next call reuse them.
template <class Op>
__device__ __forceinline__ float block_reduce(float v, float* part, Op op, float identity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x) / 32 ? part[lane] : identity;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The global position of row i of a block: pos[i], or i itself for plain causal attention (no
// positions: 0..T-1 for queries and keys alike).
__device__ __forceinline__ int64_t position(const int64_t* pos, int64_t i) {
  return pos ? pos[i] : i;
}

// Stores an f32 value: as is, or rounded to bf16 (the CPU's float_to_bf16 bits).
__device__ __forceinline__ void put(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void put(uint16_t* p, float v) {
  *p = f32_to_bf16_bits(v);
}
__device__ __forceinline__ float widen(float v) {
  return v;
}
__device__ __forceinline__ float widen(uint16_t v) {
  return bf16_bits_to_f32(v);
}

// ---- kernels -----------------------------------------------------------------------------------

// The forward's masked softmax of one row of S per block (row i = blockIdx.x of a head's
// S [Tq, ld]): in base 2, m = the max of S_ij * c over the visible keys, P_ij = exp2(S_ij * c - m)
// (0 where masked: selected, never computed), l = rowsum(P) from the unrounded P, written as
// f32 or rounded to bf16 (P may be S itself for f32: each thread reads and then writes only its
// own elements). lse = (m + log2 l) ln 2; a row that sees no key has l = 0 and lse = -inf. The
// products S_ij * c are rounded (__fmul_rn) before the subtraction, so the max entry gets exactly
// exp2(0) = 1, as on the CPU.
template <class P>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_kernel(const float* s, int64_t ld, int64_t Tk, float c,
                   const int64_t* __restrict__ q_pos, const int64_t* __restrict__ k_pos, P* p,
                   float* __restrict__ lse, float* __restrict__ rowsum) {
  __shared__ float part[32];
  const int64_t i = blockIdx.x;
  const float* srow = s + i * ld;
  P* prow = p + i * ld;
  const int64_t qp = position(q_pos, i);
  float m = kNegInf;
  for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x)
    if (position(k_pos, j) <= qp) m = fmaxf(m, __fmul_rn(srow[j], c));
  m = block_reduce(m, part, Max{}, kNegInf);
  // A row that sees nothing: subtract 0 (no exp is taken anyway).
  const float ms = m == kNegInf ? 0.0f : m;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x) {
    const float pj = position(k_pos, j) <= qp ? exp2f(__fmul_rn(srow[j], c) - ms) : 0.0f;
    sum += pj;
    put(prow + j, pj);
  }
  const float l = block_reduce(sum, part, Sum{}, 0.0f);
  if (threadIdx.x == 0) {
    rowsum[i] = l;
    lse[i] = l == 0.0f ? kNegInf : (m + log2f(l)) * kLn2;
  }
}

// The backward's probabilities and score gradients of one row per block (row i = blockIdx.x):
// from S and dP [Tq, ld] (f32), the row's final lse and delta, the CPU's expressions
//   P_ij = exp2(S_ij * c - lse_i * log2(e)),  dS_ij = (P_ij * (dP_ij - delta_i)) * scale
// where key j is visible and the row's lse is finite, exact zeros elsewhere (selected: a masked
// entry's exp could be huge, its dS even inf). P and dS are written as f32 (over S and dP: each
// thread reads and then writes only its own elements) or rounded to bf16.
template <class P>
__global__ void __launch_bounds__(kMaxRowThreads)
    grads_kernel(const float* s, const float* dp, int64_t ld, int64_t Tk, float c, float scale,
                 const int64_t* __restrict__ q_pos, const int64_t* __restrict__ k_pos,
                 const float* __restrict__ lse, const float* __restrict__ delta, P* p, P* ds) {
  const int64_t i = blockIdx.x;
  const float li = lse[i];
  const float l2 = li * kLog2e, di = delta[i];
  const bool any = li != kNegInf;
  const int64_t qp = position(q_pos, i);
  const float* srow = s + i * ld;
  const float* dprow = dp + i * ld;
  P* prow = p + i * ld;
  P* dsrow = ds + i * ld;
  for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x) {
    float pj = 0.0f, dsj = 0.0f;
    if (any && position(k_pos, j) <= qp) {
      pj = exp2f(__fmul_rn(srow[j], c) - l2);
      dsj = __fmul_rn(__fmul_rn(pj, dprow[j] - di), scale);
    }
    put(prow + j, pj);
    put(dsrow + j, dsj);
  }
}

// out[e] = O[e] / rowsum over all B*Tq*Hq*D elements (token-major, as out): the CPU's o * (1 / l),
// 0 for a row that saw no key (l = 0). O may be out itself (f32: each element is read and then
// written by one thread).
template <class Out>
__global__ void __launch_bounds__(kThreads)
    finish_kernel(const float* o, int64_t n, int64_t Tq, int64_t Hq, int64_t D,
                  const float* __restrict__ rowsum, Out* out) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t r = e / D;  // (b*Tq + t)*Hq + h
    const int64_t h = r % Hq, bt = r / Hq, t = bt % Tq, b = bt / Tq;
    const float l = rowsum[(b * Hq + h) * Tq + t];
    put(out + e, l == 0.0f ? 0.0f : o[e] * (1.0f / l));
  }
}

// delta[b, h, t] = sum_d out * dout over the row r = (b*Tq + t)*Hq + h of D elements: one warp per
// row, lane-strided fmaf then a butterfly (a fixed order). kRound: out is bf16 and dout is rounded
// to bf16 first (the bf16 backward's Di).
template <class O, bool kRound>
__global__ void __launch_bounds__(kWarpRows * 32)
    delta_kernel(const O* __restrict__ out, const float* __restrict__ dout, int64_t rows,
                 int64_t Tq, int64_t Hq, int64_t D, float* __restrict__ delta) {
  const int64_t r = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  if (r >= rows) return;  // the whole warp
  const int lane = int(threadIdx.x) % 32;
  const O* o = out + r * D;
  const float* g = dout + r * D;
  float acc = 0.0f;
  for (int64_t d = lane; d < D; d += 32) {
    const float gd = kRound ? bf16_bits_to_f32(f32_to_bf16_bits(g[d])) : g[d];
    acc = fmaf(widen(o[d]), gd, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = r % Hq, bt = r / Hq, t = bt % Tq, b = bt / Tq;
    delta[(b * Hq + h) * Tq + t] = acc;
  }
}

// attention_merge of one row per warp (row r = (b*Tq + t)*Hq + h of out, its lse at
// (b*Hq + h)*Tq + t), with the CPU's expressions.
__global__ void __launch_bounds__(kWarpRows * 32)
    merge_kernel(int64_t rows, int64_t Tq, int64_t Hq, int64_t D, float* __restrict__ out_a,
                 float* __restrict__ lse_a, const float* __restrict__ out_b,
                 const float* __restrict__ lse_b) {
  const int64_t r = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  if (r >= rows) return;  // the whole warp
  const int lane = int(threadIdx.x) % 32;
  const int64_t h = r % Hq, bt = r / Hq, t = bt % Tq, b = bt / Tq;
  const int64_t li = (b * Hq + h) * Tq + t;
  const float la = lse_a[li], lb = lse_b[li];
  __syncwarp();  // every lane has read lse_a[li] before lane 0 rewrites it
  if (lb == kNegInf) return;
  float* oa = out_a + r * D;
  const float* ob = out_b + r * D;
  if (la == kNegInf) {
    for (int64_t d = lane; d < D; d += 32) oa[d] = ob[d];
    if (lane == 0) lse_a[li] = lb;
    return;
  }
  const float m = fmaxf(la, lb);
  const float l = m + logf(expf(la - m) + expf(lb - m));
  const float wa = expf(la - l), wb = expf(lb - l);
  for (int64_t d = lane; d < D; d += 32) oa[d] = fmaf(wa, oa[d], __fmul_rn(wb, ob[d]));
  if (lane == 0) lse_a[li] = l;
}

// ---- host --------------------------------------------------------------------------------------

void check_shape(const BlockShape& s, const char* who) {
  LOOM_CHECK(s.B > 0 && s.Tq > 0 && s.Tk > 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0, who,
             ": B, Tq, Tk, Hq, Hkv, D must be positive, got B=", s.B, " Tq=", s.Tq, " Tk=", s.Tk,
             " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
  LOOM_CHECK(s.Hq % s.Hkv == 0, who, ": Hq (", s.Hq, ") must be a multiple of Hkv (", s.Hkv, ")");
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, who, ": q_stride ", s.q_stride, " < Hq*D = ", s.Hq * s.D);
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, who, ": kv_stride ", s.kv_stride,
             " < Hkv*D = ", s.Hkv * s.D);
  LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0, who, ": scale must be finite and > 0, got ",
             s.scale);
  LOOM_CHECK(s.Tq <= INT_MAX, who, ": Tq = ", s.Tq, ", more rows than one launch covers (", INT_MAX,
             ")");
}

void check_rows(const char* who, int64_t B, int64_t Tq, int64_t Hq, int64_t D) {
  LOOM_CHECK(B > 0 && Tq > 0 && Hq > 0 && D > 0, who, ": B, Tq, Hq, D must be positive, got B=", B,
             " Tq=", Tq, " Hq=", Hq, " D=", D);
  LOOM_CHECK((B * Tq * Hq + kWarpRows - 1) / kWarpRows <= INT_MAX, who, ": ", B * Tq * Hq,
             " rows, more than one launch covers");
}

BlockShape block_shape(const AttentionShape& s) {
  BlockShape b;
  b.B = s.B, b.Tq = s.T, b.Tk = s.T, b.Hq = s.Hq, b.Hkv = s.Hkv, b.D = s.D;
  b.q_stride = s.q_stride, b.kv_stride = s.kv_stride, b.scale = s.scale;
  return b;
}

// The leading dimension of the [Tq, Tk] scratch matrices: Tk rounded up to 8 elements, so that
// every row starts 16-byte aligned for bf16 and f32 alike.
int64_t scratch_ld(int64_t Tk) {
  return (Tk + 7) / 8 * 8;
}
int row_threads(int64_t n) {
  return int(std::clamp<int64_t>((n + 31) / 32 * 32, 32, kMaxRowThreads));
}

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::f32 : DType::bf16;
}
// The element of P and dS in scratch: f32 for f32 operands, bf16 bits for bf16.
template <class T>
using ProbOf = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;

uint16_t* bits(bf16* p) {
  return reinterpret_cast<uint16_t*>(p);
}
const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

// The forward of a block (plain causal attention: positions null). T: float or bf16 operands;
// Out: float, or uint16_t (bf16 bits) for the rounded output. A loop of two small GEMM calls and
// one row kernel per (sample, q head): acceptable for this exact version (a fused flash kernel
// replaces it).
//
// Scratch (released when this returns while the work may still run: the caching allocator hands a
// block out again only to work queued later on the same stream, runtime.hpp) is reused by every
// head in turn, which the stream orders.
template <class T, class Out>
void forward(const char* op, const BlockShape& s, const T* q, const T* k, const T* v,
             const int64_t* q_pos, const int64_t* k_pos, Out* out, float* lse) {
  using P = ProbOf<T>;
  constexpr bool kF32 = std::is_same_v<T, float>;
  if constexpr (!kF32) {  // bf16 at head dims 64 and 128: the fused kernels (flash_attention.hpp)
    if (flash_attention_usable(s.D, s.q_stride, s.kv_stride, q, k, v)) {
      if constexpr (std::is_same_v<Out, float>)
        flash_attention_forward_bf16(s, q, k, v, q_pos, k_pos, out, nullptr, lse);
      else
        flash_attention_forward_bf16(s, q, k, v, q_pos, k_pos, nullptr,
                                     reinterpret_cast<bf16*>(out), lse);
      return;
    }
  }
  const int64_t B = s.B, Tq = s.Tq, Tk = s.Tk, Hq = s.Hq, D = s.D, G = s.Hq / s.Hkv;
  const int64_t qs = s.q_stride, kvs = s.kv_stride, os = Hq * D, ld = scratch_ld(Tk);
  const float c = s.scale * kLog2e;
  Tensor sbuf = Tensor::empty({Tq * ld}, DType::f32, Device::cuda);
  Tensor pbuf = kF32 ? Tensor() : Tensor::empty({Tq * ld}, DType::bf16, Device::cuda);
  Tensor lbuf = Tensor::empty({B * Hq * Tq}, DType::f32, Device::cuda);
  float* S = sbuf.data<float>();
  P* Pm = kF32 ? reinterpret_cast<P*>(S) : static_cast<P*>(pbuf.raw());
  float* rowsum = lbuf.data<float>();
  // O = P V goes straight into an f32 out (normalized there in place), else into f32 scratch.
  Tensor obuf;
  float* o = nullptr;
  if constexpr (std::is_same_v<Out, float>) {
    o = out;
  } else {
    obuf = Tensor::empty({B * Tq * os}, DType::f32, Device::cuda);
    o = obuf.data<float>();
  }
  const int threads = row_threads(Tk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / G;
      const T* qh = q + b * Tq * qs + h * D;
      const T* kg = k + b * Tk * kvs + g * D;
      const T* vg = v + b * Tk * kvs + g * D;
      GemmArgs sa;  // S [Tq, Tk] = Q_h K_g^T
      sa.ta = Trans::N, sa.tb = Trans::T;
      sa.M = Tq, sa.N = Tk, sa.K = D;
      sa.A = qh, sa.lda = qs, sa.B = kg, sa.ldb = kvs;
      sa.C = S, sa.ldc = ld;
      sa.ab = dtype_of<T>();
      cuda::gemm(sa);
      const int64_t row0 = (b * Hq + h) * Tq;
      softmax_kernel<P><<<unsigned(Tq), threads, 0, stream()>>>(S, ld, Tk, c, q_pos, k_pos, Pm,
                                                                lse + row0, rowsum + row0);
      check_launch(op);
      GemmArgs pa;  // O_h [Tq, D] = P V_g (unnormalized)
      pa.M = Tq, pa.N = D, pa.K = Tk;
      pa.A = Pm, pa.lda = ld, pa.B = vg, pa.ldb = kvs;
      pa.C = o + b * Tq * os + h * D, pa.ldc = os;
      pa.ab = dtype_of<T>();
      cuda::gemm(pa);
    }
  const int64_t n = B * Tq * os;
  const unsigned blocks = std::min(blocks_for(n, kThreads), kMaxBlocks);
  finish_kernel<Out><<<blocks, kThreads, 0, stream()>>>(o, n, Tq, Hq, D, rowsum, out);
  check_launch(op);
}

// The backward of a block pair; dq, dk, dv added to (s.accumulate) or overwritten. dk and dv of a
// kv group sum the products of its Hq/Hkv query heads: the first head's GEMM writes (or adds, when
// accumulating), the others add. Five small GEMM calls and one row kernel per (sample, q head), as
// the forward.
template <class T>
void backward(const char* op, const BlockShape& s, const T* q, const T* k, const T* v,
              const int64_t* q_pos, const int64_t* k_pos, const float* lse, const float* delta,
              const float* dout, float* dq, float* dk, float* dv) {
  using P = ProbOf<T>;
  constexpr bool kF32 = std::is_same_v<T, float>;
  if constexpr (!kF32) {
    if (flash_attention_usable(s.D, s.q_stride, s.kv_stride, q, k, v)) {
      flash_attention_backward_bf16(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv);
      return;
    }
  }
  const int64_t B = s.B, Tq = s.Tq, Tk = s.Tk, Hq = s.Hq, Hkv = s.Hkv, D = s.D, G = Hq / Hkv;
  const int64_t qs = s.q_stride, kvs = s.kv_stride, os = Hq * D, ld = scratch_ld(Tk);
  const float c = s.scale * kLog2e;
  const DType ab = dtype_of<T>();
  // dO as the GEMMs read it: dout itself, or rounded to bf16 once.
  Tensor dobuf;
  const void* dO = dout;
  if constexpr (!kF32) {
    dobuf = Tensor::empty({B * Tq * os}, DType::bf16, Device::cuda);
    cast_f32_to_bf16(dout, dobuf.data<bf16>(), B * Tq * os);
    dO = dobuf.raw();
  }
  const size_t o_elem = kF32 ? sizeof(float) : sizeof(bf16);
  Tensor sbuf = Tensor::empty({Tq * ld}, DType::f32, Device::cuda);
  Tensor dpbuf = Tensor::empty({Tq * ld}, DType::f32, Device::cuda);
  Tensor pbuf = kF32 ? Tensor() : Tensor::empty({Tq * ld}, DType::bf16, Device::cuda);
  Tensor dsbuf = kF32 ? Tensor() : Tensor::empty({Tq * ld}, DType::bf16, Device::cuda);
  float* S = sbuf.data<float>();
  float* dP = dpbuf.data<float>();
  P* Pm = kF32 ? reinterpret_cast<P*>(S) : static_cast<P*>(pbuf.raw());
  P* dS = kF32 ? reinterpret_cast<P*>(dP) : static_cast<P*>(dsbuf.raw());
  const int threads = row_threads(Tk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        const T* qh = q + b * Tq * qs + h * D;
        const T* kg = k + b * Tk * kvs + g * D;
        const T* vg = v + b * Tk * kvs + g * D;
        const void* doh = static_cast<const char*>(dO) + size_t(b * Tq * os + h * D) * o_elem;
        GemmArgs sa;  // S [Tq, Tk] = Q_h K_g^T
        sa.tb = Trans::T;
        sa.M = Tq, sa.N = Tk, sa.K = D;
        sa.A = qh, sa.lda = qs, sa.B = kg, sa.ldb = kvs;
        sa.C = S, sa.ldc = ld, sa.ab = ab;
        cuda::gemm(sa);
        GemmArgs pa;  // dP [Tq, Tk] = dO_h V_g^T
        pa.tb = Trans::T;
        pa.M = Tq, pa.N = Tk, pa.K = D;
        pa.A = doh, pa.lda = os, pa.B = vg, pa.ldb = kvs;
        pa.C = dP, pa.ldc = ld, pa.ab = ab;
        cuda::gemm(pa);
        const int64_t row0 = (b * Hq + h) * Tq;
        grads_kernel<P><<<unsigned(Tq), threads, 0, stream()>>>(
            S, dP, ld, Tk, c, s.scale, q_pos, k_pos, lse + row0, delta + row0, Pm, dS);
        check_launch(op);
        const bool add_kv = s.accumulate || hh > 0;
        GemmArgs va;  // dV_g [Tk, D] (+)= P^T dO_h
        va.ta = Trans::T;
        va.M = Tk, va.N = D, va.K = Tq;
        va.A = Pm, va.lda = ld, va.B = doh, va.ldb = os;
        va.C = dv + b * Tk * kvs + g * D, va.ldc = kvs, va.ab = ab, va.accumulate = add_kv;
        cuda::gemm(va);
        GemmArgs ka;  // dK_g [Tk, D] (+)= dS^T Q_h
        ka.ta = Trans::T;
        ka.M = Tk, ka.N = D, ka.K = Tq;
        ka.A = dS, ka.lda = ld, ka.B = qh, ka.ldb = qs;
        ka.C = dk + b * Tk * kvs + g * D, ka.ldc = kvs, ka.ab = ab, ka.accumulate = add_kv;
        cuda::gemm(ka);
        GemmArgs qa;  // dQ_h [Tq, D] (+)= dS K_g
        qa.M = Tq, qa.N = D, qa.K = Tk;
        qa.A = dS, qa.lda = ld, qa.B = kg, qa.ldb = kvs;
        qa.C = dq + b * Tq * qs + h * D, qa.ldc = qs, qa.ab = ab, qa.accumulate = s.accumulate;
        cuda::gemm(qa);
      }
}

template <class O, bool kRound>
void row_delta(const char* op, int64_t B, int64_t Tq, int64_t Hq, int64_t D, const O* out,
               const float* dout, float* d) {
  check_rows(op, B, Tq, Hq, D);
  LOOM_CHECK(out && dout && d, op, ": null pointer among out, dout, delta");
  const int64_t rows = B * Tq * Hq;
  delta_kernel<O, kRound>
      <<<unsigned((rows + kWarpRows - 1) / kWarpRows), kWarpRows * 32, 0, stream()>>>(
          out, dout, rows, Tq, Hq, D, d);
  check_launch(op);
}

}  // namespace

void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse) {
  const BlockShape bs = block_shape(s);
  check_shape(bs, "attention_forward");
  LOOM_CHECK(q && k && v && out && lse, "attention_forward: null pointer among q, k, v, out, lse");
  forward("attention_forward", bs, q, k, v, nullptr, nullptr, out, lse);
}

void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv) {
  BlockShape bs = block_shape(s);
  check_shape(bs, "attention_backward");
  LOOM_CHECK(q && k && v && out && lse && dout && dq && dk && dv,
             "attention_backward: null pointer among q, k, v, out, lse, dout, dq, dk, dv");
  Tensor d = Tensor::empty({s.B * s.Hq * s.T}, DType::f32, Device::cuda);
  attention_delta(s.B, s.T, s.Hq, s.D, out, dout, d.data<float>());
  bs.accumulate = false;  // dq, dk, dv are outputs here
  backward("attention_backward", bs, q, k, v, nullptr, nullptr, lse, d.data<float>(), dout, dq, dk,
           dv);
}

void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            float* out, float* lse) {
  const BlockShape bs = block_shape(s);
  check_shape(bs, "attention_forward_bf16");
  LOOM_CHECK(q && k && v && out && lse,
             "attention_forward_bf16: null pointer among q, k, v, out, lse");
  forward("attention_forward_bf16", bs, q, k, v, nullptr, nullptr, out, lse);
}

void attention_forward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                            bf16* out, float* lse) {
  const BlockShape bs = block_shape(s);
  check_shape(bs, "attention_forward_bf16");
  LOOM_CHECK(q && k && v && out && lse,
             "attention_forward_bf16: null pointer among q, k, v, out, lse");
  forward("attention_forward_bf16", bs, q, k, v, nullptr, nullptr, bits(out), lse);
}

void attention_backward_bf16(const AttentionShape& s, const bf16* q, const bf16* k, const bf16* v,
                             const bf16* out, const float* lse, const float* dout, float* dq,
                             float* dk, float* dv) {
  BlockShape bs = block_shape(s);
  check_shape(bs, "attention_backward_bf16");
  LOOM_CHECK(q && k && v && out && lse && dout && dq && dk && dv,
             "attention_backward_bf16: null pointer among q, k, v, out, lse, dout, dq, dk, dv");
  Tensor d = Tensor::empty({s.B * s.Hq * s.T}, DType::f32, Device::cuda);
  attention_delta_bf16(s.B, s.T, s.Hq, s.D, out, dout, d.data<float>());
  bs.accumulate = false;
  backward("attention_backward_bf16", bs, q, k, v, nullptr, nullptr, lse, d.data<float>(), dout, dq,
           dk, dv);
}

void attention_block_forward(const BlockShape& s, const float* q, const float* k, const float* v,
                             const int64_t* q_pos, const int64_t* k_pos, float* out, float* lse) {
  check_shape(s, "attention_block_forward");
  LOOM_CHECK(q && k && v && q_pos && k_pos && out && lse,
             "attention_block_forward: null pointer among q, k, v, q_pos, k_pos, out, lse");
  forward("attention_block_forward", s, q, k, v, q_pos, k_pos, out, lse);
}

void attention_block_forward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                  const int64_t* q_pos, const int64_t* k_pos, float* out,
                                  float* lse) {
  check_shape(s, "attention_block_forward_bf16");
  LOOM_CHECK(q && k && v && q_pos && k_pos && out && lse,
             "attention_block_forward_bf16: null pointer among q, k, v, q_pos, k_pos, out, lse");
  forward("attention_block_forward_bf16", s, q, k, v, q_pos, k_pos, out, lse);
}

void attention_block_backward(const BlockShape& s, const float* q, const float* k, const float* v,
                              const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                              const float* delta, const float* dout, float* dq, float* dk,
                              float* dv) {
  check_shape(s, "attention_block_backward");
  LOOM_CHECK(q && k && v && q_pos && k_pos && lse && delta && dout && dq && dk && dv,
             "attention_block_backward: null pointer among q, k, v, q_pos, k_pos, lse, delta, "
             "dout, dq, dk, dv");
  backward("attention_block_backward", s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv);
}

void attention_block_backward_bf16(const BlockShape& s, const bf16* q, const bf16* k, const bf16* v,
                                   const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                                   const float* delta, const float* dout, float* dq, float* dk,
                                   float* dv) {
  check_shape(s, "attention_block_backward_bf16");
  LOOM_CHECK(q && k && v && q_pos && k_pos && lse && delta && dout && dq && dk && dv,
             "attention_block_backward_bf16: null pointer among q, k, v, q_pos, k_pos, lse, "
             "delta, dout, dq, dk, dv");
  backward("attention_block_backward_bf16", s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv);
}

void attention_merge(int64_t B, int64_t Tq, int64_t Hq, int64_t D, float* out_a, float* lse_a,
                     const float* out_b, const float* lse_b) {
  check_rows("attention_merge", B, Tq, Hq, D);
  LOOM_CHECK(out_a && lse_a && out_b && lse_b,
             "attention_merge: null pointer among out_a, lse_a, out_b, lse_b");
  const int64_t rows = B * Tq * Hq;
  merge_kernel<<<unsigned((rows + kWarpRows - 1) / kWarpRows), kWarpRows * 32, 0, stream()>>>(
      rows, Tq, Hq, D, out_a, lse_a, out_b, lse_b);
  check_launch("attention_merge");
}

void attention_delta(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const float* out,
                     const float* dout, float* delta) {
  row_delta<float, false>("attention_delta", B, Tq, Hq, D, out, dout, delta);
}

void attention_delta_bf16(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const bf16* out,
                          const float* dout, float* delta) {
  row_delta<uint16_t, true>("attention_delta_bf16", B, Tq, Hq, D, bits(out), dout, delta);
}

}  // namespace loom::cuda
