#include "kernels/cuda/cross_entropy.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/gemm.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {
namespace {

// Threads of a row's block: one float4 each up to this many, then they loop. 512 threads and at
// most 64 registers keep four blocks on an SM (a 512-row chunk of logits is one wave on an H100).
constexpr int kMaxThreads = 512;
// The block that sums the per-row losses.
constexpr int kSumThreads = 1024;

// ---- rows of floats: a scalar head up to the first 16-byte boundary, float4s, a scalar tail.

struct Split {
  int64_t head;  // elements before the first 16-byte boundary (at most 3, at most n)
  int64_t vecs;  // float4s from there
  int64_t tail;  // the first element after them
};
__device__ __forceinline__ Split split_row(const float* p, int64_t n) {
  const int64_t off = int64_t((reinterpret_cast<uintptr_t>(p) >> 2) & 3);
  const int64_t head = min(n, (4 - off) & 3);
  const int64_t vecs = (n - head) / 4;
  return {head, vecs, head + 4 * vecs};
}

// f(j, row[j]) for this thread's elements of the row's first n, in an order fixed by n, the
// row's alignment and blockDim.x: the head and tail elements by the first threads, float4 k by
// thread k % blockDim.x.
template <class F>
__device__ __forceinline__ void for_each(const float* row, int64_t n, F&& f) {
  const Split s = split_row(row, n);
  const int64_t tid = threadIdx.x;
  if (tid < s.head) f(tid, row[tid]);
  const float4* v = reinterpret_cast<const float4*>(row + s.head);
  for (int64_t k = tid; k < s.vecs; k += blockDim.x) {
    const float4 q = v[k];
    const int64_t j = s.head + 4 * k;
    f(j, q.x);
    f(j + 1, q.y);
    f(j + 2, q.z);
    f(j + 3, q.w);
  }
  if (tid < n - s.tail) f(s.tail + tid, row[s.tail + tid]);
}

// row[j] = f(j, row[j]) for j < n (each element read and written by the same thread).
template <class F>
__device__ __forceinline__ void map_in_place(float* row, int64_t n, F&& f) {
  const Split s = split_row(row, n);
  const int64_t tid = threadIdx.x;
  if (tid < s.head) row[tid] = f(tid, row[tid]);
  float4* v = reinterpret_cast<float4*>(row + s.head);
  for (int64_t k = tid; k < s.vecs; k += blockDim.x) {
    const float4 q = v[k];
    const int64_t j = s.head + 4 * k;
    v[k] = make_float4(f(j, q.x), f(j + 1, q.y), f(j + 2, q.z), f(j + 3, q.w));
  }
  if (tid < n - s.tail) row[s.tail + tid] = f(s.tail + tid, row[s.tail + tid]);
}

// out[j] = bf16(f(j, row[j])) for j < n: the loads as for_each, the four bf16 of a float4 in one
// 8-byte store where out + head is 8-byte aligned (uniform over the row), else one at a time.
template <class F>
__device__ __forceinline__ void map_to_bf16(const float* row, int64_t n, uint16_t* out, F&& f) {
  const Split s = split_row(row, n);
  const int64_t tid = threadIdx.x;
  if (tid < s.head) out[tid] = f32_to_bf16_bits(f(tid, row[tid]));
  const float4* v = reinterpret_cast<const float4*>(row + s.head);
  uint16_t* o = out + s.head;
  const bool wide = (reinterpret_cast<uintptr_t>(o) & 7) == 0;
  for (int64_t k = tid; k < s.vecs; k += blockDim.x) {
    const float4 q = v[k];
    const int64_t j = s.head + 4 * k;
    const float a = f(j, q.x), b = f(j + 1, q.y), c = f(j + 2, q.z), d = f(j + 3, q.w);
    if (wide) {
      reinterpret_cast<uint2*>(o)[k] = make_uint2(pack2(a, b), pack2(c, d));
    } else {
      o[4 * k] = f32_to_bf16_bits(a);
      o[4 * k + 1] = f32_to_bf16_bits(b);
      o[4 * k + 2] = f32_to_bf16_bits(c);
      o[4 * k + 3] = f32_to_bf16_bits(d);
    }
  }
  if (tid < n - s.tail) out[s.tail + tid] = f32_to_bf16_bits(f(s.tail + tid, row[s.tail + tid]));
}

// Zeros over a row of n floats, or of n bf16.
__device__ __forceinline__ void zero_row(float* row, int64_t n) {
  map_in_place(row, n, [](int64_t, float) { return 0.0f; });
}
__device__ __forceinline__ void zero_row(uint16_t* row, int64_t n) {
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) row[j] = 0;
}

// ---- block reductions in a fixed order: a butterfly within each warp, the warps' results by
// warp 0 in the same butterfly, the result broadcast through part[32] (part: 33 shared values).
// The order depends on blockDim.x alone (a multiple of 32). A barrier at the end lets the caller
// reuse `part`.

// A running maximum and sum of exp(x - m) (an online softmax's state). m is never NaN: only a
// larger x replaces it, and a NaN x goes into the sum.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ void add(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;  // exp(-inf) = 0 for the first element
    a.m = x;
  } else if (a.m > -INFINITY || x != x) {
    a.s += expf(x - a.m);  // skipped only for -inf before anything larger came
  }
}
// Commutative bit for bit (the butterfly's two lanes get the same value). A part that saw no
// finite element (s == 0) adds nothing; one that saw a NaN keeps it.
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = a.m > b.m ? a.m : b.m;
  const float sa = a.s == 0.0f ? 0.0f : a.s * expf(a.m - m);
  const float sb = b.s == 0.0f ? 0.0f : b.s * expf(b.m - m);
  return {m, sa + sb};
}
__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int o) {
  return {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
}
__device__ __forceinline__ float shfl_xor(float v, int o) {
  return __shfl_xor_sync(0xffffffffu, v, o);
}
__device__ __forceinline__ double shfl_xor(double v, int o) {
  return __shfl_xor_sync(0xffffffffu, v, o);
}

template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T identity, Op op, T* part) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x) / 32 ? part[lane] : identity;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
    if (lane == 0) part[32] = v;
  }
  __syncthreads();
  const T r = part[32];
  __syncthreads();
  return r;
}

__device__ __forceinline__ double quiet_nan() {
  return __longlong_as_double(0x7ff8000000000000LL);
}

// ---- the fused loss's row kernel

// Row r = blockIdx.x of a chunk of f32 logits [rows, V] with its target: the row's loss into
// row_loss[r] (0 for an ignored row, NaN for a target >= V), and with kGrad its gradient
// grad_scale * (softmax - onehot): in place (f32), or rounded to bf16 into g16's row r (kBf16).
// An ignored or out-of-range row reads no logit and gets a zero gradient row.
template <bool kGrad, bool kBf16>
__global__ void __launch_bounds__(kMaxThreads)
    ce_rows_kernel(float* logits, int64_t V, const int32_t* __restrict__ targets, float scale,
                   uint16_t* __restrict__ g16, double* __restrict__ row_loss) {
  __shared__ MaxSum part[33];
  const int64_t r = blockIdx.x;
  float* row = logits + r * V;
  const int64_t t = targets[r];
  if (t < 0 || t >= V) {
    if (threadIdx.x == 0) row_loss[r] = t < 0 ? 0.0 : quiet_nan();
    if constexpr (kGrad) {
      if constexpr (kBf16)
        zero_row(g16 + r * V, V);
      else
        zero_row(row, V);
    }
    return;
  }
  // Read before the barriers of the reduction, so before any thread rewrites the row.
  const float logit_t = threadIdx.x == 0 ? row[t] : 0.0f;
  MaxSum a{-INFINITY, 0.0f};
  for_each(row, V, [&](int64_t, float x) { add(a, x); });
  const MaxSum b = block_reduce(
      a, MaxSum{-INFINITY, 0.0f}, [](MaxSum x, MaxSum y) { return combine(x, y); }, part);
  if (threadIdx.x == 0) row_loss[r] = double(logf(b.s)) + (double(b.m) - double(logit_t));
  if constexpr (kGrad) {
    const float k = scale / b.s;
    // exp * k, and at the target exp * k - scale (one rounding: the CPU's expression, which its
    // compiler may fuse, the same value or a closer one).
    const auto grad = [&](int64_t j, float x) {
      const float e = expf(x - b.m);
      return j == t ? fmaf(e, k, -scale) : __fmul_rn(e, k);
    };
    if constexpr (kBf16)
      map_to_bf16(row, V, g16 + r * V, grad);
    else
      map_in_place(row, V, grad);
  }
}

// *out = the sum of v[0, n) in double: thread i sums v[i], v[i + 1024], ... in turn, then the
// block's fixed tree. The order depends on n alone.
__global__ void __launch_bounds__(kSumThreads)
    sum_kernel(const double* __restrict__ v, int64_t n, double* __restrict__ out) {
  __shared__ double part[33];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
  s = block_reduce(
      s, 0.0, [](double x, double y) { return x + y; }, part);
  if (threadIdx.x == 0) *out = s;
}

// The first (smallest) row whose target is >= V, with its target, into *record.
__global__ void check_targets_kernel(const int32_t* __restrict__ targets, int64_t n, int64_t V,
                                     unsigned long long* __restrict__ record) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t t = targets[i];
  if (int64_t(t) >= V) atomicMin(record, (static_cast<unsigned long long>(i) << 32) | uint32_t(t));
}

// ---- the vocabulary-parallel pieces

// Row r = blockIdx.x: the CPU's vocab_shard_lse (the max in f32, the exponentials of the f32
// differences summed in double).
__global__ void __launch_bounds__(kMaxThreads)
    shard_lse_kernel(const float* __restrict__ logits, int64_t V, int64_t Vr,
                     const int32_t* __restrict__ targets, int64_t v0, float* __restrict__ lse,
                     float* __restrict__ target_logit) {
  __shared__ float part_f[33];
  __shared__ double part_d[33];
  const int64_t r = blockIdx.x;
  const float* row = logits + r * V;
  if (threadIdx.x == 0) {
    const int64_t t = targets[r];
    target_logit[r] = t >= v0 && t < v0 + V ? row[t - v0] : 0.0f;
  }
  if (Vr == 0) {
    if (threadIdx.x == 0) lse[r] = -INFINITY;
    return;
  }
  // std::max(m, x) of the CPU: a NaN x leaves m (the sum below carries it).
  const auto max_op = [](float m, float x) { return m < x ? x : m; };
  float m = -INFINITY;
  for_each(row, Vr, [&](int64_t, float x) { m = max_op(m, x); });
  m = block_reduce(m, -INFINITY, max_op, part_f);
  double s = 0.0;
  for_each(row, Vr, [&](int64_t, float x) { s += exp(double(x - m)); });
  s = block_reduce(
      s, 0.0, [](double x, double y) { return x + y; }, part_d);
  if (threadIdx.x == 0) lse[r] = float(double(m) + log(s));
}

// Row i per thread: the CPU's vocab_shard_combine row, its loss into row_loss[i].
__global__ void shard_combine_kernel(const float* __restrict__ lse_all, int n, int64_t N,
                                     const int32_t* __restrict__ targets,
                                     const float* __restrict__ target_logit,
                                     float* __restrict__ glse, double* __restrict__ row_loss) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  float mx = -INFINITY;
  for (int r = 0; r < n; ++r) {
    const float l = lse_all[r * N + i];
    mx = mx < l ? l : mx;
  }
  double s = 0.0;
  for (int r = 0; r < n; ++r) s += exp(double(lse_all[r * N + i] - mx));
  const float g = float(double(mx) + log(s));
  glse[i] = g;
  row_loss[i] = targets[i] >= 0 ? double(g) - double(target_logit[i]) : 0.0;
}

// Row r = blockIdx.x: the CPU's vocab_shard_dlogits row (exp * scale rounded, then the target's
// subtraction: no fused multiply-add).
__global__ void __launch_bounds__(kMaxThreads)
    shard_dlogits_kernel(float* logits, int64_t V, int64_t Vr, const int32_t* __restrict__ targets,
                         int64_t v0, const float* __restrict__ glse, float scale) {
  const int64_t r = blockIdx.x;
  float* row = logits + r * V;
  const int64_t t = targets[r];
  if (t < 0) {
    zero_row(row, V);
    return;
  }
  const float g = glse[r];
  const int64_t tc = t >= v0 && t < v0 + V ? t - v0 : -1;
  map_in_place(row, V, [&](int64_t j, float x) {
    const float y = j < Vr ? __fmul_rn(expf(x - g), scale) : 0.0f;
    return j == tc ? __fsub_rn(y, scale) : y;
  });
}

// ---- host side

int threads_for(int64_t n) {
  const int64_t vectors = (n + 3) / 4;
  return int(std::clamp<int64_t>((vectors + 31) / 32 * 32, 32, kMaxThreads));
}

void sum_rows(const char* op, const double* row_loss, int64_t n, double* out) {
  sum_kernel<<<1, kSumThreads, 0, stream()>>>(row_loss, n, out);
  check_launch(op);
}

// The call's scratch, carved at 256-byte offsets from one block (kernels/cuda/scratch.hpp).
using Layout = LossLayout;
Layout layout(int64_t N, int64_t V, const LinearCrossEntropyChunks& ch, bool grad16) {
  return loss_layout(N, V, ch, grad16);
}

void check_args(const LinearCrossEntropyArgs& a) {
  LOOM_CHECK(a.ab == DType::f32 || a.ab == DType::bf16,
             "linear_cross_entropy: x and w must be float32 or bfloat16, got ", dtype_name(a.ab));
  LOOM_CHECK(a.N >= 0 && a.D > 0 && a.V > 0, "linear_cross_entropy: expected N >= 0, D > 0, ",
             "V > 0, got N=", a.N, " D=", a.D, " V=", a.V);
  LOOM_CHECK(a.chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0 (0: automatic), ",
             "got ", a.chunk_rows);
  LOOM_CHECK(a.N <= INT_MAX, "linear_cross_entropy: ", a.N, " rows, more than one launch covers (",
             INT_MAX, ")");
  LOOM_CHECK(a.V <= INT_MAX, "linear_cross_entropy: a vocabulary of ", a.V,
             " is more than int32 targets index (", INT_MAX, ")");
}

void check_shard_rows(const char* op, int64_t rows, int64_t V, int64_t Vr) {
  LOOM_CHECK(rows >= 0 && rows <= INT_MAX, op, ": rows must be in [0, ", INT_MAX, "], got ", rows);
  LOOM_CHECK(V > 0 && Vr >= 0 && Vr <= V, op, ": expected V > 0 and 0 <= Vr <= V, got V=", V,
             " Vr=", Vr);
}

}  // namespace

void clear_bad_target(uint64_t* record) {
  LOOM_CHECK(record, "clear_bad_target: the record is null");
  LOOM_CUDA_CHECK(cudaMemsetAsync(record, 0xff, sizeof(uint64_t), stream()), "clear_bad_target");
}

void bad_target_error(uint64_t value, int64_t V) {
  if (value == kNoBadTarget) return;
  const int64_t row = int64_t(value >> 32);
  const int32_t target = int32_t(uint32_t(value & 0xffffffffu));
  fail("linear_cross_entropy: target ", target, " of row ", row,
       " is out of range for a vocabulary of ", V, " (expected < ", V,
       ", or < 0 to ignore the row)");
}

void check_bad_target(const uint64_t* record, int64_t V) {
  LOOM_CHECK(record, "check_bad_target: the record is null");
  uint64_t value = kNoBadTarget;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&value, record, sizeof value, cudaMemcpyDeviceToHost, stream()),
                  "check_bad_target");
  synchronize("check_bad_target");
  bad_target_error(value, V);
}

LinearCrossEntropyChunks linear_cross_entropy_chunks(int64_t N, int64_t V, int64_t chunk_rows,
                                                     int64_t grad_rows) {
  return loss_chunks(N, V, chunk_rows, grad_rows);
}

size_t linear_cross_entropy_scratch_bytes(int64_t N, int64_t D, int64_t V, DType ab, bool grad,
                                          int64_t chunk_rows, int64_t grad_rows) {
  (void)D;  // no packed copy of w on the device: the scratch does not depend on D
  if (N <= 0) return 0;
  const bool grad16 = ab == DType::bf16 && grad;
  const LinearCrossEntropyChunks ch =
      linear_cross_entropy_chunks(N, V, chunk_rows, grad16 ? grad_rows : 0);
  return layout(N, V, ch, grad16).bytes;
}

namespace {

// Both entry points: the targets checked into bad_target, or into the call's own record, which is
// waited for and thrown before any output is touched (!later) or left to the next wait (later).
void run_linear_cross_entropy(const LinearCrossEntropyArgs& a, double* loss_out,
                              uint64_t* bad_target, bool later) {
  const char* op = "linear_cross_entropy";
  check_args(a);
  if (a.N == 0) {
    if (a.dw && a.dw_overwrite)
      LOOM_CUDA_CHECK(cudaMemsetAsync(a.dw, 0, size_t(a.V) * size_t(a.D) * sizeof(float), stream()),
                      op);
    if (loss_out) LOOM_CUDA_CHECK(cudaMemsetAsync(loss_out, 0, sizeof(double), stream()), op);
    return;
  }
  LOOM_CHECK(a.x && a.w && a.targets, "linear_cross_entropy: x, w and targets must be non-null");

  const bool need_grad = a.dx || a.dw;
  const bool grad16 = a.ab == DType::bf16 && need_grad;
  const LinearCrossEntropyChunks ch =
      linear_cross_entropy_chunks(a.N, a.V, a.chunk_rows, grad16 ? a.grad_rows : 0);
  const Layout lay = layout(a.N, a.V, ch, grad16);
  const size_t esz = dtype_size(a.ab);
  // One block for the call, counted as the loss's; released when this returns while the kernels
  // may still run: the caching allocator hands it out again only to work queued later on the
  // same stream (runtime.hpp).
  Tensor scratch;
  {
    const MemoryUseScope use(Device::cuda, MemoryUse::loss);
    scratch = Tensor::empty({int64_t((lay.bytes + 3) / 4)}, DType::i32, Device::cuda);
  }
  char* base = static_cast<char*>(scratch.raw());
  float* L = reinterpret_cast<float*>(base + lay.logits);
  uint16_t* G16 = grad16 ? reinterpret_cast<uint16_t*>(base + lay.g16) : nullptr;
  double* row_loss = reinterpret_cast<double*>(base + lay.loss);

  // The targets are checked first: into the caller's record, or into the scratch's, waited for
  // and thrown before any output is touched, or checked at the next wait.
  uint64_t* record = bad_target ? bad_target : reinterpret_cast<uint64_t*>(base + lay.record);
  if (!bad_target) clear_bad_target(record);
  check_targets_kernel<<<blocks_for(a.N, 256), 256, 0, stream()>>>(
      a.targets, a.N, a.V, reinterpret_cast<unsigned long long*>(record));
  check_launch(op);
  if (!bad_target && later) {
    // The copy is queued now, before the scratch's block can be handed out again.
    defer_check(record, [V = a.V](uint64_t value) { bad_target_error(value, V); });
  } else if (!bad_target) {
    check_bad_target(record, a.V);
  }

  const int threads = threads_for(a.V);
  const void* dlogits = G16 ? static_cast<const void*>(G16) : static_cast<const void*>(L);
  // Groups of grad_rows rows (one chunk's unless bf16 gathers several): the logits and the row
  // kernel chunk by chunk into the group's gradients, then the two backward GEMMs over the group.
  for (int64_t g0 = 0; g0 < a.N; g0 += ch.grad_rows) {
    const int64_t gn = std::min(ch.grad_rows, a.N - g0);
    for (int64_t r0 = g0; r0 < g0 + gn; r0 += ch.rows) {
      const int64_t c = std::min(ch.rows, g0 + gn - r0);
      GemmArgs f;
      f.tb = Trans::T;
      f.M = c;
      f.N = a.V;
      f.K = a.D;
      f.A = static_cast<const char*>(a.x) + size_t(r0) * size_t(a.D) * esz;
      f.lda = a.D;
      f.B = a.w;
      f.ldb = a.D;
      f.C = L;
      f.ldc = a.V;
      f.ab = a.ab;
      cuda::gemm(f);
      const int32_t* tg = a.targets + r0;
      double* rl = row_loss + r0;
      if (!need_grad) {
        ce_rows_kernel<false, false>
            <<<unsigned(c), threads, 0, stream()>>>(L, a.V, tg, a.grad_scale, nullptr, rl);
      } else if (G16) {
        uint16_t* g = G16 + size_t(r0 - g0) * size_t(a.V);
        ce_rows_kernel<true, true>
            <<<unsigned(c), threads, 0, stream()>>>(L, a.V, tg, a.grad_scale, g, rl);
      } else {
        ce_rows_kernel<true, false>
            <<<unsigned(c), threads, 0, stream()>>>(L, a.V, tg, a.grad_scale, nullptr, rl);
      }
      check_launch(op);
    }
    if (a.dx) {
      GemmArgs b;
      b.M = gn;
      b.N = a.D;
      b.K = a.V;
      b.A = dlogits;
      b.lda = a.V;
      b.B = a.w;
      b.ldb = a.D;
      b.C = a.dx + size_t(g0) * size_t(a.D);
      b.ldc = a.D;
      b.ab = a.ab;
      cuda::gemm(b);
    }
    if (a.dw) {
      GemmArgs b;
      b.ta = Trans::T;
      b.M = a.V;
      b.N = a.D;
      b.K = gn;
      b.A = dlogits;
      b.lda = a.V;
      b.B = static_cast<const char*>(a.x) + size_t(g0) * size_t(a.D) * esz;
      b.ldb = a.D;
      b.C = a.dw;
      b.ldc = a.D;
      b.ab = a.ab;
      b.accumulate = !(a.dw_overwrite && g0 == 0);
      cuda::gemm(b);
    }
  }
  if (loss_out) sum_rows(op, row_loss, a.N, loss_out);
}

}  // namespace

void linear_cross_entropy(const LinearCrossEntropyArgs& a, double* loss_out, uint64_t* bad_target) {
  run_linear_cross_entropy(a, loss_out, bad_target, false);
}

void linear_cross_entropy_checked_later(const LinearCrossEntropyArgs& a, double* loss_out) {
  run_linear_cross_entropy(a, loss_out, nullptr, true);
}

void vocab_shard_lse(const float* logits, int64_t rows, int64_t V, int64_t Vr,
                     const int32_t* targets, int64_t v0, float* lse, float* target_logit) {
  const char* op = "vocab_shard_lse";
  check_shard_rows(op, rows, V, Vr);
  if (rows == 0) return;
  shard_lse_kernel<<<unsigned(rows), threads_for(Vr), 0, stream()>>>(logits, V, Vr, targets, v0,
                                                                     lse, target_logit);
  check_launch(op);
}

void vocab_shard_combine(const float* lse_all, int n, int64_t N, const int32_t* targets,
                         const float* target_logit, float* glse, double* loss_out) {
  const char* op = "vocab_shard_combine";
  LOOM_CHECK(n >= 1 && N >= 0, op, ": expected n >= 1 ranks and N >= 0 rows, got n=", n, " N=", N);
  LOOM_CHECK(loss_out, op, ": loss_out is null");
  if (N == 0) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(loss_out, 0, sizeof(double), stream()), op);
    return;
  }
  // Released when this returns: reused only by work queued later on the stream (runtime.hpp).
  const ScratchBlock rows = vocab_shard_combine_scratch(N)[0];  // what a meta run books
  Tensor scratch = Tensor::empty({rows.numel}, rows.dtype, Device::cuda);
  auto* row_loss = reinterpret_cast<double*>(scratch.raw());
  shard_combine_kernel<<<blocks_for(N, 256), 256, 0, stream()>>>(lse_all, n, N, targets,
                                                                 target_logit, glse, row_loss);
  check_launch(op);
  sum_rows(op, row_loss, N, loss_out);
}

void vocab_shard_dlogits(float* logits, int64_t rows, int64_t V, int64_t Vr, const int32_t* targets,
                         int64_t v0, const float* glse, float grad_scale) {
  const char* op = "vocab_shard_dlogits";
  check_shard_rows(op, rows, V, Vr);
  if (rows == 0) return;
  shard_dlogits_kernel<<<unsigned(rows), threads_for(V), 0, stream()>>>(logits, V, Vr, targets, v0,
                                                                        glse, grad_scale);
  check_launch(op);
}

}  // namespace loom::cuda
