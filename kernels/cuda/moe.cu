#include "kernels/cuda/moe.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/bias_gate.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/moe_rows.cuh"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// The router's blocks: one thread per token.
constexpr int kRouteThreads = 128;
// Blocks of the row kernels: at most this many (grid-stride loops beyond).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
// moe_permute: the assignments one warp walks (a chunk: scratch.hpp's, which sizes the chunks'
// counts), and the most experts its shared per-expert counters hold (32 KiB of int32, under the
// 48 KiB a block may use without opting in).
constexpr int64_t kChunk = kMoeChunk;
constexpr int64_t kMaxExperts = 8192;
// The "nothing bad" value of a recorded first bad assignment (memset to 0xff bytes; every
// assignment index is below it, as M*k <= INT_MAX).
constexpr uint32_t kNone = 0xffffffffu;
// Quiet NaNs: an f32, a bf16, two bf16 in a word (the row a bad index would produce).
constexpr uint32_t kNanF32 = 0x7fc00000u, kNanBf16x2 = 0x7fc07fc0u;
constexpr uint16_t kNanBf16 = 0x7fc0u;

unsigned capped_blocks(int64_t items, int per_block) {
  return unsigned(std::clamp<int64_t>((items + per_block - 1) / per_block, 1, kMaxBlocks));
}
int row_threads(int64_t d) {
  return int(std::min<int64_t>((d + 31) / 32 * 32, kThreads));
}

// ---- the router --------------------------------------------------------------------------------

// Token t's softmax, the CPU's loops in its order (no __restrict__: logits and probs may be one
// array; each logit is read before its probability is written). Apart from the top-k below: the
// exp's and divisions' slow paths are calls, and in one kernel the values live across them
// spilled.
__global__ void __launch_bounds__(kRouteThreads)
    softmax_kernel(const float* logits, int64_t M, int64_t E, float* probs) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= M) return;
  const float* x = logits + t * E;
  float* p = probs + t * E;
  float m = x[0];
  for (int64_t e = 1; e < E; ++e) m = m < x[e] ? x[e] : m;  // std::max's choice, NaN included
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    const float ex = exp_f32(__fsub_rn(x[e], m));
    p[e] = ex;
    sum = __dadd_rn(sum, double(ex));
  }
  for (int64_t e = 0; e < E; ++e) p[e] = float(__ddiv_rn(double(p[e]), sum));
}

// Token t's k passes of an argmax over probs + bias among the experts not taken yet: strict >
// keeps the lower index on a tie (and some index even where scores are NaN); the weights the
// chosen probabilities, renormalized in f32 in choice order. experts[t, :] is written pass by pass
// and read back by the same thread (the experts taken).
__global__ void __launch_bounds__(kRouteThreads)
    top_k_kernel(const float* __restrict__ probs, const float* __restrict__ bias, int64_t M,
                 int64_t E, int64_t k, bool renormalize, int32_t* experts,
                 float* __restrict__ weights) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= M) return;
  const float* p = probs + t * E;
  int32_t* ex = experts + t * k;
  float* w = weights + t * k;
  float s = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    float top = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ex[i] == e;
      if (taken) continue;
      const float score = bias ? __fadd_rn(p[e], bias[e]) : p[e];
      if (best < 0 || score > top) best = e, top = score;
    }
    ex[j] = int32_t(best);
    w[j] = p[best];
    s = __fadd_rn(s, p[best]);
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) w[j] = __fdiv_rn(w[j], s);
}

// Token t's dlogits, the CPU's double arithmetic in its order. dp_e (the CPU's array) is formed
// where it is used: dprob[e], then each choice j of expert e added in j order. dlogits may be
// probs: p[e] is read before out[e] is written, and nothing reads p[e] after.
__global__ void __launch_bounds__(kRouteThreads)
    route_backward_kernel(const float* probs, const int32_t* __restrict__ experts,
                          const float* __restrict__ weights, const float* __restrict__ dweights,
                          int64_t M, int64_t E, int64_t k, bool renormalize,
                          const float* __restrict__ dprob, float* dlogits) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= M) return;
  const float* p = probs + t * E;
  const int32_t* ex = experts + t * k;
  const float* w = weights + t * k;
  const float* dw = dweights + t * k;
  float* out = dlogits + t * E;
  bool ok = true;
  for (int64_t j = 0; j < k; ++j) ok = ok && ex[j] >= 0 && ex[j] < E;
  if (!ok) {
    for (int64_t e = 0; e < E; ++e) out[e] = __uint_as_float(kNanF32);
    return;
  }
  float s = 0.0f;  // the forward's sum, in its order
  double c = 0.0;
  if (renormalize) {
    for (int64_t j = 0; j < k; ++j) s = __fadd_rn(s, p[ex[j]]);
    for (int64_t j = 0; j < k; ++j) c = __dadd_rn(c, __dmul_rn(double(dw[j]), double(w[j])));
  }
  auto dp = [&](int64_t e) {
    double v = dprob ? double(dprob[e]) : 0.0;
    for (int64_t j = 0; j < k; ++j)
      if (ex[j] == e)
        v = __dadd_rn(
            v, renormalize ? __ddiv_rn(__dsub_rn(double(dw[j]), c), double(s)) : double(dw[j]));
    return v;
  };
  double dot = 0.0;
  for (int64_t e = 0; e < E; ++e) dot = __dadd_rn(dot, __dmul_rn(double(p[e]), dp(e)));
  for (int64_t e = 0; e < E; ++e) out[e] = float(__dmul_rn(double(p[e]), __dsub_rn(dp(e), dot)));
}

// ---- tokens grouped by expert ------------------------------------------------------------------

// One warp walks chunk blockIdx.x (kChunk consecutive assignments) 32 at a time; run[e] (shared)
// is the rank the chunk's next assignment of expert e takes. Within a step the lanes of one
// expert (__match_any_sync) rank in lane order after run[e], and the lowest of them advances it.
// !kPlace: run starts at 0, and the chunk's counts go to hist[chunk, :]; an assignment whose
// expert is outside [0, E) is recorded in *bad (the smallest kept: atomicMin, exact in any order)
// and not counted. kPlace: run starts at hist[chunk, :] (the expert's assignments before the
// chunk), and pos[a] = start[e] + rank while the rank is below counts[e], else -1 (dropped).
template <bool kPlace>
__global__ void __launch_bounds__(32)
    permute_walk_kernel(const int32_t* __restrict__ experts, int64_t n, int64_t E,
                        int32_t* __restrict__ hist, const int64_t* __restrict__ counts,
                        const int32_t* __restrict__ start, int32_t* __restrict__ pos,
                        uint32_t* __restrict__ bad) {
  extern __shared__ int32_t run[];
  const int lane = int(threadIdx.x);
  const int64_t a0 = int64_t(blockIdx.x) * kChunk, a1 = a0 + kChunk < n ? a0 + kChunk : n;
  int32_t* h = hist + int64_t(blockIdx.x) * E;
  for (int64_t e = lane; e < E; e += 32) run[e] = kPlace ? h[e] : 0;
  __syncwarp();
  const unsigned before = (1u << lane) - 1u;
  for (int64_t base = a0; base < a1; base += 32) {
    const int64_t a = base + lane;
    int32_t e = a < a1 ? experts[a] : -1;
    if (a < a1 && (e < 0 || e >= E)) {
      if (!kPlace) atomicMin(bad, uint32_t(a));
      e = -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int32_t rank = e >= 0 ? run[e] + __popc(same & before) : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) run[e] += __popc(same);
    __syncwarp();
    if (kPlace && e >= 0) pos[a] = rank < counts[e] ? start[e] + rank : -1;
  }
  if (!kPlace)
    for (int64_t e = lane; e < E; e += 32) h[e] = run[e];
}

// One block: per expert, hist's column turned into exclusive sums over the chunks (the expert's
// assignments before each chunk) and its kept rows counts[e] (capped by capacity[e] where a
// capacity is given); then the
// experts' starts, exclusive sums of counts in expert order (one thread: E is small), and the
// recorded bad assignment copied beside the counts (out = counts [E] then bad, one copy home).
__global__ void __launch_bounds__(kThreads)
    permute_scan_kernel(int32_t* __restrict__ hist, int64_t chunks, int64_t E,
                        const int64_t* __restrict__ capacity, const uint32_t* __restrict__ bad,
                        int64_t* __restrict__ out, int32_t* __restrict__ start) {
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t total = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t v = hist[c * E + e];
      hist[c * E + e] = int32_t(total);
      total += v;
    }
    out[e] = capacity && total > capacity[e] ? capacity[e] : total;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    start[e] = int32_t(rows);
    rows += out[e];
  }
  out[E] = int64_t(*bad);
}

// order[pos[a]] = a for each kept a (a row outside [0, N) is never written).
__global__ void __launch_bounds__(kThreads)
    permute_order_kernel(const int32_t* __restrict__ pos, int64_t n, int64_t N,
                         int32_t* __restrict__ order) {
  const int64_t a = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (a >= n) return;
  const int32_t p = pos[a];
  if (p >= 0 && p < N) order[p] = int32_t(a);
}

// Row i of xs = row order[i] / k of x, as W words (the element, or 16 bytes); NaN words where
// order[i] is outside [0, M*k).
template <class W>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(const W* __restrict__ x, int64_t M, int64_t words,
                    const int32_t* __restrict__ order, int64_t N, int64_t k, W nan,
                    W* __restrict__ xs) {
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t o = order[i];
    W* dst = xs + i * words;
    const bool ok = o >= 0 && o < M * k;
    const W* src = x + (ok ? o / k : 0) * words;
    for (int64_t c = threadIdx.x; c < words; c += blockDim.x) dst[c] = ok ? src[c] : nan;
  }
}

// Whether token t's k rows are all in [-1, N) (-1: dropped).
__device__ __forceinline__ bool rows_ok(const int32_t* pt, int64_t k, int64_t N) {
  bool ok = true;
  for (int64_t j = 0; j < k; ++j) ok = ok && pt[j] >= -1 && pt[j] < N;
  return ok;
}

// Token t = blockIdx.x (grid-stride): dx[t, c] = (dx or 0) + its kept rows of dxs in j order.
__global__ void __launch_bounds__(kThreads)
    dispatch_backward_kernel(const float* __restrict__ dxs, int64_t N,
                             const int32_t* __restrict__ pos, int64_t M, int64_t k, int64_t d,
                             float* __restrict__ dx, bool accumulate) {
  for (int64_t t = blockIdx.x; t < M; t += gridDim.x) {
    const int32_t* pt = pos + t * k;
    const bool ok = rows_ok(pt, k, N);
    float* r = dx + t * d;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = accumulate ? r[c] : 0.0f;
      for (int64_t j = 0; ok && j < k; ++j)
        if (pt[j] >= 0) acc = __fadd_rn(acc, dxs[int64_t(pt[j]) * d + c]);
      r[c] = ok ? acc : __uint_as_float(kNanF32);
    }
  }
}

// Token t = blockIdx.x (grid-stride): y[t, c] += w_j ys[pos_j, c] in j order, each product
// rounded, then added.
template <class Y>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const Y* __restrict__ ys, int64_t N, const float* __restrict__ weights,
                   const int32_t* __restrict__ pos, int64_t M, int64_t k, int64_t d,
                   float* __restrict__ y) {
  for (int64_t t = blockIdx.x; t < M; t += gridDim.x) {
    const int32_t* pt = pos + t * k;
    const float* wt = weights + t * k;
    const bool ok = rows_ok(pt, k, N);
    float* r = y + t * d;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = r[c];
      for (int64_t j = 0; ok && j < k; ++j)
        if (pt[j] >= 0) acc = __fadd_rn(acc, __fmul_rn(wt[j], widen(ys[int64_t(pt[j]) * d + c])));
      r[c] = ok ? acc : __uint_as_float(kNanF32);
    }
  }
}

// One warp per assignment a = t*k + j: dys[pos[a]] = w dy[t] and dweights[a] = dy[t] . ys[pos[a]]
// (0 where dropped, NaN where pos[a] is outside [-1, N)).
template <class Y, class D>
__global__ void __launch_bounds__(kThreads)
    combine_backward_kernel(const float* __restrict__ dy, const Y* __restrict__ ys, int64_t N,
                            const float* __restrict__ weights, const int32_t* __restrict__ pos,
                            int64_t M, int64_t k, int64_t d, D* __restrict__ dys,
                            float* __restrict__ dweights) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t n = M * k, step = int64_t(gridDim.x) * kWarps;
  for (int64_t a = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; a < n; a += step) {
    const int64_t p = pos[a];
    if (p < 0 || p >= N) {
      if (lane == 0) dweights[a] = p == -1 ? 0.0f : __uint_as_float(kNanF32);
      continue;
    }
    const double dot =
        scaled_copy_dot(dy + (a / k) * d, ys + p * d, d, weights[a], dys + p * d, lane);
    if (lane == 0) dweights[a] = float(dot);
  }
}

// ---- host side ---------------------------------------------------------------------------------

// The CPU kernels' checks and messages (kernels/cpu/moe.cpp).
void check_router(const char* what, int64_t M, int64_t E, int64_t k) {
  LOOM_CHECK(M >= 0, what, ": token count M must be >= 0, got ", M);
  LOOM_CHECK(E > 0, what, ": expert count E must be > 0, got ", E);
  LOOM_CHECK(k >= 1 && k <= E, what, ": k (experts per token) must be in [1, E = ", E, "], got ",
             k);
  LOOM_CHECK(M <= INT_MAX, what, ": ", M, " tokens, more than one launch covers (", INT_MAX, ")");
}
void check_rows(const char* what, int64_t M, int64_t N, int64_t k, int64_t d) {
  LOOM_CHECK(M >= 0 && N >= 0, what, ": row counts must be >= 0, got M ", M, ", N ", N);
  LOOM_CHECK(k >= 1, what, ": k (experts per token) must be >= 1, got ", k);
  LOOM_CHECK(d > 0, what, ": row width d must be > 0, got ", d);
  LOOM_CHECK(M * k <= INT_MAX && N <= INT_MAX, what, ": ", M * k, " assignments and ", N,
             " rows do not fit the int32 rows of pos and order");
}

uint16_t* bits(bf16* p) {
  return reinterpret_cast<uint16_t*>(p);
}
const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

// Rows as 16-byte words where every row starts 16-byte aligned, else element by element.
template <class T>
void dispatch(const T* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k, T* xs) {
  const char* what = "moe_dispatch";
  check_rows(what, M, N, k, d);
  if (N == 0) return;
  const unsigned blocks = unsigned(std::min(N, kMaxBlocks));
  const int64_t bytes = d * int64_t(sizeof(T));
  if (bytes % 16 == 0 && aligned16(x) && aligned16(xs)) {
    const uint32_t w = sizeof(T) == 4 ? kNanF32 : kNanBf16x2;
    dispatch_kernel<<<blocks, row_threads(bytes / 16), 0, stream()>>>(
        reinterpret_cast<const uint4*>(x), M, bytes / 16, order, N, k, make_uint4(w, w, w, w),
        reinterpret_cast<uint4*>(xs));
  } else if constexpr (sizeof(T) == 4) {
    dispatch_kernel<<<blocks, row_threads(d), 0, stream()>>>(
        x, M, d, order, N, k, std::numeric_limits<float>::quiet_NaN(), xs);
  } else {
    dispatch_kernel<<<blocks, row_threads(d), 0, stream()>>>(x, M, d, order, N, k, kNanBf16, xs);
  }
  check_launch(what);
}

template <class Y>
void combine(const Y* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M, int64_t k,
             int64_t d, float* y) {
  const char* what = "moe_combine";
  check_rows(what, M, N, k, d);
  if (M == 0) return;
  combine_kernel<<<unsigned(std::min(M, kMaxBlocks)), row_threads(d), 0, stream()>>>(
      ys, N, weights, pos, M, k, d, y);
  check_launch(what);
}

template <class Y, class D>
void combine_backward(const float* dy, const Y* ys, int64_t N, const float* weights,
                      const int32_t* pos, int64_t M, int64_t k, int64_t d, D* dys,
                      float* dweights) {
  const char* what = "moe_combine_backward";
  check_rows(what, M, N, k, d);
  if (M == 0) return;
  combine_backward_kernel<<<capped_blocks(M * k, kWarps), kThreads, 0, stream()>>>(
      dy, ys, N, weights, pos, M, k, d, dys, dweights);
  check_launch(what);
}

}  // namespace

void moe_route(const float* logits, const float* bias, int64_t M, int64_t E, int64_t k,
               bool renormalize, float* probs, int32_t* experts, float* weights, float* prob_sum) {
  const char* what = "moe_route";
  check_router(what, M, E, k);
  LOOM_CHECK(E <= INT_MAX, what, ": E = ", E, " experts do not fit the int32 expert indices");
  if (M == 0) return;
  const unsigned blocks = blocks_for(M, kRouteThreads);
  softmax_kernel<<<blocks, kRouteThreads, 0, stream()>>>(logits, M, E, probs);
  check_launch(what);
  top_k_kernel<<<blocks, kRouteThreads, 0, stream()>>>(probs, bias, M, E, k, renormalize, experts,
                                                       weights);
  check_launch(what);
  if (prob_sum) bias_grad(probs, M, E, E, prob_sum);
}

void moe_route_backward(const float* probs, const int32_t* experts, const float* weights,
                        const float* dweights, int64_t M, int64_t E, int64_t k, bool renormalize,
                        const float* dprob, float* dlogits) {
  const char* what = "moe_route_backward";
  check_router(what, M, E, k);
  if (M == 0) return;
  route_backward_kernel<<<blocks_for(M, kRouteThreads), kRouteThreads, 0, stream()>>>(
      probs, experts, weights, dweights, M, E, k, renormalize, dprob, dlogits);
  check_launch(what);
}

int64_t moe_permute_per_expert(const int32_t* experts, int64_t M, int64_t k, int64_t E,
                               const int64_t* capacity, int64_t* counts, int32_t* pos) {
  const char* what = "moe_permute";
  check_router(what, M, E, k);
  if (capacity)
    for (int64_t e = 0; e < E; ++e)
      LOOM_CHECK(capacity[e] >= 0, what, ": expert ", e, "'s capacity must be >= 0, got ",
                 capacity[e]);
  const int64_t n = M * k;
  LOOM_CHECK(n <= INT_MAX, what, ": M*k = ", n,
             " assignments do not fit the int32 rows of pos and order");
  LOOM_CHECK(E <= kMaxExperts, what, ": E = ", E, " experts, more than the ", kMaxExperts,
             " the CUDA kernel's per-expert counters hold");
  std::fill(counts, counts + E, int64_t{0});
  if (n == 0) return 0;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  // Scratch, released when this returns: the caching allocator hands a block out again only to
  // work queued later on the same stream (runtime.hpp). out: the counts then the bad assignment,
  // E + 1 int64 (two int32 elements each), the one copy home.
  // The blocks a meta run books (scratch.hpp).
  const std::vector<ScratchBlock> blocks = moe_permute_scratch(n, E, capacity != nullptr);
  const auto block = [&](size_t i) {
    return Tensor::empty({blocks[i].numel}, blocks[i].dtype, Device::cuda);
  };
  Tensor t_hist = block(0), t_start = block(1), t_out = block(2), t_bad = block(3);
  Tensor t_capacity;
  if (capacity) {
    t_capacity = block(4);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(t_capacity.raw(), capacity, size_t(E) * sizeof(int64_t),
                                    cudaMemcpyHostToDevice, stream()),
                    what);
  }
  int32_t* hist = t_hist.data<int32_t>();
  int32_t* start = t_start.data<int32_t>();
  auto* out = static_cast<int64_t*>(t_out.raw());
  auto* bad = static_cast<uint32_t*>(t_bad.raw());
  const size_t shared = size_t(E) * sizeof(int32_t);

  LOOM_CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof(uint32_t), stream()), what);
  permute_walk_kernel<false><<<unsigned(chunks), 32, shared, stream()>>>(
      experts, n, E, hist, nullptr, nullptr, nullptr, bad);
  check_launch(what);
  permute_scan_kernel<<<1, kThreads, 0, stream()>>>(
      hist, chunks, E, capacity ? static_cast<const int64_t*>(t_capacity.raw()) : nullptr, bad, out,
      start);
  check_launch(what);
  // The counts size the experts' GEMMs on the host: the one wait of the op.
  std::vector<int64_t> host(size_t(E + 1));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(host.data(), out, host.size() * sizeof(int64_t),
                                  cudaMemcpyDeviceToHost, stream()),
                  what);
  synchronize(what);
  if (host[size_t(E)] != int64_t(kNone)) {
    const int64_t a = host[size_t(E)];
    int32_t e = 0;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&e, experts + a, sizeof e, cudaMemcpyDeviceToHost, stream()),
                    what);
    synchronize(what);
    fail(what, ": expert index ", e, " at assignment ", a, " is out of range [0, ", E, ")");
  }
  permute_walk_kernel<true>
      <<<unsigned(chunks), 32, shared, stream()>>>(experts, n, E, hist, out, start, pos, nullptr);
  check_launch(what);
  std::memcpy(counts, host.data(), size_t(E) * sizeof(int64_t));
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) rows += counts[e];
  return n - rows;
}

void moe_permute_order(const int32_t* pos, int64_t n, int64_t N, int32_t* order) {
  const char* what = "moe_permute_order";
  LOOM_CHECK(n >= 0 && N >= 0 && N <= n, what, ": ", N, " rows of ", n,
             " assignments (0 <= N <= assignments)");
  LOOM_CHECK(n <= INT_MAX, what, ": ", n, " assignments do not fit the int32 rows of order");
  if (n == 0) return;
  permute_order_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream()>>>(pos, n, N, order);
  check_launch(what);
}

void moe_dispatch(const float* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  float* xs) {
  dispatch(x, M, d, order, N, k, xs);
}
void moe_dispatch(const bf16* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  bf16* xs) {
  dispatch(bits(x), M, d, order, N, k, bits(xs));
}

void moe_dispatch_backward(const float* dxs, int64_t N, const int32_t* pos, int64_t M, int64_t k,
                           int64_t d, float* dx, bool accumulate) {
  const char* what = "moe_dispatch_backward";
  check_rows(what, M, N, k, d);
  if (M == 0) return;
  dispatch_backward_kernel<<<unsigned(std::min(M, kMaxBlocks)), row_threads(d), 0, stream()>>>(
      dxs, N, pos, M, k, d, dx, accumulate);
  check_launch(what);
}

void moe_combine(const float* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y) {
  combine(ys, N, weights, pos, M, k, d, y);
}
void moe_combine(const bf16* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y) {
  combine(bits(ys), N, weights, pos, M, k, d, y);
}

void moe_combine_backward(const float* dy, const float* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, float* dys,
                          float* dweights) {
  combine_backward(dy, ys, N, weights, pos, M, k, d, dys, dweights);
}
void moe_combine_backward(const float* dy, const bf16* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, float* dys,
                          float* dweights) {
  combine_backward(dy, bits(ys), N, weights, pos, M, k, d, dys, dweights);
}
void moe_combine_backward(const float* dy, const float* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, bf16* dys,
                          float* dweights) {
  combine_backward(dy, ys, N, weights, pos, M, k, d, bits(dys), dweights);
}
void moe_combine_backward(const float* dy, const bf16* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, bf16* dys,
                          float* dweights) {
  combine_backward(dy, bits(ys), N, weights, pos, M, k, d, bits(dys), dweights);
}

}  // namespace loom::cuda
