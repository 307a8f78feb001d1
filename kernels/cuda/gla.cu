#include "kernels/cuda/gla.hpp"

#include <algorithm>
#include <climits>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"

namespace loom::cuda {
namespace {

// Every kernel runs blocks of 8 warps. The per-chunk kernels give each lane one column (of V or
// K) of a 32-wide tile and each thread 8 rows of a chunk (rows w, w + 8, ..., w + 56 of a group of
// 64 rows for warp w, so that the triangular loops end at about the same row in every warp);
// chunks of more than 64 rows are walked 64 rows at a time.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;
constexpr int kRowsPerThread = 8;
constexpr int kRowGroup = kWarps * kRowsPerThread;  // 64
// Rows of a chunk per step of a state update (their decayed coefficients staged in shared memory).
constexpr int kUpdateRows = 16;
// Blocks of the element-wise kernels: at most this many (a grid-stride loop beyond).
constexpr unsigned kMaxBlocks = 1u << 20;

// The problem with every stride resolved, passed to the kernels by value.
struct Dims {
  int64_t B, T, H, Hkv, K, V;
  int64_t C;   // chunk
  int64_t NT;  // chunks per sample
  int64_t G;   // query heads per kv head
  float scale;
};
struct In {
  const float* p;
  int64_t ld;
};
struct Out {
  float* p;
  int64_t ld;
};

// Where chunk n of sample b starts and how many rows it has.
struct Chunk {
  int64_t t0, m, row0;  // first token, rows, first row of [B*T, ...]
};
__device__ __forceinline__ Chunk chunk_of(const Dims& s, int64_t b, int64_t n) {
  const int64_t t0 = n * s.C;
  return {t0, s.T - t0 < s.C ? s.T - t0 : s.C, b * s.T + t0};
}

// A decay factor e^x (x <= 0), exactly 0 below -87 (the CPU's dexp): products of such factors
// would be denormals, meaningless next to the other terms.
__device__ __forceinline__ float dexp(float x) {
  return x < -87.0f ? 0.0f : expf(x);
}
// e^(a - b) from the double cumsum: the difference in double, rounded once to f32 (the CPU's
// float(a - b)).
__device__ __forceinline__ float dexp_diff(double a, double b) {
  return dexp(__double2float_rn(a - b));
}

// The sum over the warp, the same bits in every lane (both lanes of a pair add the same values).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// ---- 1. the chunk-local cumsum -----------------------------------------------------------------

// bc[row, i] = sum of gk over the rows of the chunk up to `row`, in double, in token order (the
// CPU's cumsum: the first row copied, then prev + g). Block x: (sample, chunk); y: 256 columns of
// the Hkv*K.
__global__ void __launch_bounds__(kThreads) cumsum_kernel(In gk, Dims s, double* __restrict__ bc) {
  const int64_t W = s.Hkv * s.K;
  const int64_t i = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (i >= W) return;
  const Chunk c = chunk_of(s, blockIdx.x / s.NT, blockIdx.x % s.NT);
  double acc = double(gk.p[c.row0 * gk.ld + i]);
  bc[c.row0 * W + i] = acc;
  for (int64_t r = 1; r < c.m; ++r) {
    acc += double(gk.p[(c.row0 + r) * gk.ld + i]);
    bc[(c.row0 + r) * W + i] = acc;
  }
}

// ---- 2. intra-chunk scores ---------------------------------------------------------------------

// out[r, j] = alpha * sum_d x_r[d] y_j[d] (e^(b_r[d] - b_j[d]) when kDecay) for j <= r < m, per
// (sample, query head, chunk): x is the query head's (q, or dout), y the kv head's (k, or v), both
// D wide; out [B*H, T, C] (row t of head bh at (bh*T + t)*C). A: x = q, y = k, kDecay, alpha =
// scale (the CPU's scale * dot(q_r, k_j e^(b_r - b_j))); dA: x = dout, y = v, alpha = 1.
// Block x: (sample, query head, chunk); y: a tile pair (rt >= jt) of the chunk's 32 x 32 tiles.
// Entries above the diagonal are never written (nothing reads them).
template <bool kDecay>
__global__ void __launch_bounds__(kThreads)
    scores_kernel(In x, In y, const double* __restrict__ bc, Dims s, int64_t D, float alpha,
                  float* __restrict__ out) {
  __shared__ float xs[kTile][kTile + 1], ys[kTile][kTile + 1];
  __shared__ double bx[kDecay ? kTile : 1][kTile + 1], by[kDecay ? kTile : 1][kTile + 1];
  const int64_t n = blockIdx.x % s.NT, bh = blockIdx.x / s.NT;
  const int64_t h = bh % s.H, b = bh / s.H, hk = h / s.G;
  const Chunk c = chunk_of(s, b, n);
  int rt = 0, p = int(blockIdx.y);
  while (p > rt) p -= ++rt;
  const int jt = p;
  const int64_t r0 = int64_t(rt) * kTile, j0 = int64_t(jt) * kTile;
  if (r0 >= c.m) return;  // a tile past the end of a short last chunk (the whole block)
  const int tx = int(threadIdx.x) % kTile, ty = int(threadIdx.x) / kTile;
  const int64_t W = s.Hkv * s.K;
  const float* xb = x.p + c.row0 * x.ld + h * D;
  const float* yb = y.p + c.row0 * y.ld + hk * D;
  const double* bb = bc + c.row0 * W + hk * s.K;
  float acc[kTile / kWarps] = {};
  for (int64_t d0 = 0; d0 < D; d0 += kTile) {
    for (int e = ty; e < kTile; e += kWarps) {
      const int64_t d = d0 + tx, r = r0 + e, j = j0 + e;
      const bool rin = d < D && r < c.m, jin = d < D && j < c.m;
      xs[e][tx] = rin ? xb[r * x.ld + d] : 0.0f;
      ys[e][tx] = jin ? yb[j * y.ld + d] : 0.0f;
      if constexpr (kDecay) {
        bx[e][tx] = rin ? bb[r * W + d] : 0.0;
        by[e][tx] = jin ? bb[j * W + d] : 0.0;
      }
    }
    __syncthreads();
    const int dn = D - d0 < kTile ? int(D - d0) : kTile;
    for (int dd = 0; dd < dn; ++dd) {
      const float yv = ys[tx][dd];
#pragma unroll
      for (int i = 0; i < kTile / kWarps; ++i) {
        const int e = ty + kWarps * i;
        if (j0 + tx > r0 + e) continue;
        if constexpr (kDecay)
          acc[i] = fmaf(xs[e][dd], yv * dexp_diff(bx[e][dd], by[tx][dd]), acc[i]);
        else
          acc[i] = fmaf(xs[e][dd], yv, acc[i]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kTile / kWarps; ++i) {
    const int64_t r = r0 + ty + kWarps * i, j = j0 + tx;
    if (r < c.m && j <= r) out[(bh * s.T + c.t0 + r) * s.C + j] = alpha * acc[i];
  }
}

// ---- 3. the state sweeps -----------------------------------------------------------------------

// Shared memory of a sweep block: S [K][32], the decayed coefficients of kUpdateRows rows
// [kUpdateRows][K], and (the forward's output) q~ [64][33].
size_t sweep_smem(int64_t K) {
  return sizeof(float) * size_t(K * kTile + kUpdateRows * K + kRowGroup * (kTile + 1));
}

// S[d][lane] <- e^(b_last[d]) S[d][lane] + sum_{j<m} coef(j, d) x_j (in row order), where x_j is
// this lane's column of row j (xrow(j): a pointer to the lane's element, or null past V). Thread
// (w, lane) owns S[d][lane] for d = w, w + 8, ...; the coefficients of kUpdateRows rows at a time
// are computed once into shared memory (ct). Ends with a barrier: S is then read by every thread.
template <class Coef, class XRow>
__device__ __forceinline__ void decay_update(float* S, float* ct, int64_t K, int64_t m,
                                             const double* blast, Coef coef, XRow xrow) {
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  for (int64_t d = w; d < K; d += kWarps) S[d * kTile + lane] *= dexp(__double2float_rn(blast[d]));
  for (int64_t j0 = 0; j0 < m; j0 += kUpdateRows) {
    const int jn = m - j0 < kUpdateRows ? int(m - j0) : kUpdateRows;
    __syncthreads();  // the previous rows' coefficients are read
    // 32-bit: K is bounded by the shared memory (check_args), so jn * K is small.
    const int kk = int(K);
    for (int e = int(threadIdx.x); e < jn * kk; e += kThreads) ct[e] = coef(j0 + e / kk, e % kk);
    float xv[kUpdateRows];
#pragma unroll
    for (int jj = 0; jj < kUpdateRows; ++jj) {
      const float* p = jj < jn ? xrow(j0 + jj) : nullptr;
      xv[jj] = p ? *p : 0.0f;
    }
    __syncthreads();
    for (int64_t d = w; d < K; d += kWarps) {
      float acc = S[d * kTile + lane];
#pragma unroll
      for (int jj = 0; jj < kUpdateRows; ++jj)
        if (jj < jn) acc = fmaf(ct[jj * K + d], xv[jj], acc);
      S[d * kTile + lane] = acc;
    }
  }
  __syncthreads();
}

// The forward sweep of one (sample, query head, 32 columns of V) per block: S from h0 (or 0),
// then per chunk in order: states[n] = S (when storing, the backward's recompute), the chunk's
// output o_r = sum_d (scale (q_r[d] e^b_r[d])) S[d] + sum_{j<=r} A[r, j] v_j (when o.p; the CPU's
// order: the state part over d, then the intra part over j), then the update
// S <- Diag(e^b_last) S + sum_j (k_j e^(b_last - b_j)) v_j^T. At the end states[NT] and ht.
__global__ void __launch_bounds__(kThreads)
    forward_sweep_kernel(In q, In k, In v, const double* __restrict__ bc,
                         const float* __restrict__ A, const float* __restrict__ h0, Dims s, Out o,
                         float* __restrict__ ht, float* __restrict__ states) {
  extern __shared__ __align__(16) float dyn_smem[];
  const int64_t K = s.K, V = s.V, W = s.Hkv * s.K;
  float* S = dyn_smem;        // [K][32]
  float* ct = S + K * kTile;  // [kUpdateRows][K]
  float(*qt)[kTile + 1] = reinterpret_cast<float(*)[kTile + 1]>(ct + kUpdateRows * K);  // [64]
  const int64_t nvs = (V + kTile - 1) / kTile;
  const int64_t bh = blockIdx.x / nvs, h = bh % s.H, b = bh / s.H, hk = h / s.G;
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int64_t col = int64_t(blockIdx.x % nvs) * kTile + lane;
  const bool cin = col < V;
  const size_t head = size_t(bh) * size_t(K * V);
  for (int64_t d = w; d < K; d += kWarps)
    S[d * kTile + lane] = h0 && cin ? h0[head + d * V + col] : 0.0f;
  __syncthreads();
  for (int64_t n = 0; n < s.NT; ++n) {
    const Chunk c = chunk_of(s, b, n);
    const double* bb = bc + c.row0 * W + hk * K;
    const float* vb = v.p + c.row0 * v.ld + hk * V + col;
    if (states && cin)
      for (int64_t d = w; d < K; d += kWarps)
        states[(size_t(bh) * (s.NT + 1) + n) * (K * V) + d * V + col] = S[d * kTile + lane];
    if (o.p) {
      const float* qb = q.p + c.row0 * q.ld + h * K;
      for (int64_t rg = 0; rg < c.m; rg += kRowGroup) {
        float acc[kRowsPerThread] = {};
        for (int64_t d0 = 0; d0 < K; d0 += kTile) {
          for (int e = w; e < kRowGroup; e += kWarps) {
            const int64_t r = rg + e, d = d0 + lane;
            qt[e][lane] =
                r < c.m && d < K
                    ? s.scale * (qb[r * q.ld + d] * dexp(__double2float_rn(bb[r * W + d])))
                    : 0.0f;
          }
          __syncthreads();
          const int dn = K - d0 < kTile ? int(K - d0) : kTile;
          for (int dd = 0; dd < dn; ++dd) {
            const float sv = S[(d0 + dd) * kTile + lane];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i)
              acc[i] = fmaf(qt[w + kWarps * i][dd], sv, acc[i]);
          }
          __syncthreads();
        }
        const float* Ab = A + (bh * s.T + c.t0) * s.C;
        const int64_t last = min64(c.m - 1, rg + w + kWarps * (kRowsPerThread - 1));
        for (int64_t j = 0; j <= last; ++j) {
          const float vj = cin ? vb[j * v.ld] : 0.0f;
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int64_t r = rg + w + kWarps * i;
            if (j <= r && r < c.m) acc[i] = fmaf(Ab[r * s.C + j], vj, acc[i]);
          }
        }
        if (cin)
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int64_t r = rg + w + kWarps * i;
            if (r < c.m) o.p[(c.row0 + r) * o.ld + h * V + col] = acc[i];
          }
      }
    }
    const double* blast = bb + (c.m - 1) * W;
    const float* kb = k.p + c.row0 * k.ld + hk * K;
    decay_update(
        S, ct, K, c.m, blast,
        [&](int64_t j, int64_t d) { return kb[j * k.ld + d] * dexp_diff(blast[d], bb[j * W + d]); },
        [&](int64_t j) { return cin ? vb + j * v.ld : nullptr; });
  }
  if (cin)
    for (int64_t d = w; d < K; d += kWarps) {
      const float x = S[d * kTile + lane];
      if (states) states[(size_t(bh) * (s.NT + 1) + s.NT) * (K * V) + d * V + col] = x;
      if (ht) ht[head + d * V + col] = x;
    }
}

// The reverse sweep of one (sample, query head, 32 columns of V) per block: dS from dht (or 0),
// then per chunk n from the last: dstates[n] = dS (= dL/dS_[n+1]), then
// dS <- Diag(e^b_last) dS + sum_r (scale (q_r e^b_r)) dO_r^T (the CPU's order). dh0 = the final dS.
__global__ void __launch_bounds__(kThreads)
    backward_sweep_kernel(In q, In dout, const double* __restrict__ bc,
                          const float* __restrict__ dht, Dims s, float* __restrict__ dstates,
                          float* __restrict__ dh0) {
  extern __shared__ __align__(16) float dyn_smem[];
  const int64_t K = s.K, V = s.V, W = s.Hkv * s.K;
  float* S = dyn_smem;
  float* ct = S + K * kTile;
  const int64_t nvs = (V + kTile - 1) / kTile;
  const int64_t bh = blockIdx.x / nvs, h = bh % s.H, b = bh / s.H, hk = h / s.G;
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int64_t col = int64_t(blockIdx.x % nvs) * kTile + lane;
  const bool cin = col < V;
  const size_t head = size_t(bh) * size_t(K * V);
  for (int64_t d = w; d < K; d += kWarps)
    S[d * kTile + lane] = dht && cin ? dht[head + d * V + col] : 0.0f;
  __syncthreads();
  for (int64_t n = s.NT - 1; n >= 0; --n) {
    const Chunk c = chunk_of(s, b, n);
    const double* bb = bc + c.row0 * W + hk * K;
    if (cin)
      for (int64_t d = w; d < K; d += kWarps)
        dstates[(size_t(bh) * s.NT + n) * (K * V) + d * V + col] = S[d * kTile + lane];
    const float* qb = q.p + c.row0 * q.ld + h * K;
    const float* db = dout.p + c.row0 * dout.ld + h * V + col;
    decay_update(
        S, ct, K, c.m, bb + (c.m - 1) * W,
        [&](int64_t r, int64_t d) {
          return s.scale * (qb[r * q.ld + d] * dexp(__double2float_rn(bb[r * W + d])));
        },
        [&](int64_t r) { return cin ? db + r * dout.ld : nullptr; });
  }
  if (dh0 && cin)
    for (int64_t d = w; d < K; d += kWarps) dh0[head + d * V + col] = S[d * kTile + lane];
}

// ---- 4. the per-chunk gradients ----------------------------------------------------------------

// dv of one (sample, kv head, chunk, 32 columns of V) per block; row j of the chunk:
//   dv_j = sum over the group's query heads h in order of
//          [ sum_{r>=j} A_h[r, j] dO_h,r  then  sum_d (k_j[d] e^(b_last[d] - b_j[d])) dS_h[d] ]
// (the CPU's order), dS_h = dstates of head h after this chunk. dv overwritten.
__global__ void __launch_bounds__(kThreads)
    dv_kernel(In k, In dout, const double* __restrict__ bc, const float* __restrict__ A,
              const float* __restrict__ dstates, Dims s, Out dv) {
  __shared__ float kt[kRowGroup][kTile + 1];
  const int64_t K = s.K, V = s.V, W = s.Hkv * s.K;
  const int64_t n = blockIdx.x % s.NT, bk = blockIdx.x / s.NT, hk = bk % s.Hkv, b = bk / s.Hkv;
  const Chunk c = chunk_of(s, b, n);
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int64_t col = int64_t(blockIdx.y) * kTile + lane;
  const bool cin = col < V;
  const double* bb = bc + c.row0 * W + hk * K;
  const double* blast = bb + (c.m - 1) * W;
  const float* kb = k.p + c.row0 * k.ld + hk * K;
  for (int64_t rg = 0; rg < c.m; rg += kRowGroup) {
    float acc[kRowsPerThread] = {};
    for (int64_t hh = 0; hh < s.G; ++hh) {
      const int64_t h = hk * s.G + hh, bh = b * s.H + h;
      const float* Ab = A + (bh * s.T + c.t0) * s.C;
      const float* db = dout.p + c.row0 * dout.ld + h * V + col;
      for (int64_t r = rg + w; r < c.m; ++r) {
        const float g = cin ? db[r * dout.ld] : 0.0f;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int64_t j = rg + w + kWarps * i;
          if (j <= r) acc[i] = fmaf(Ab[r * s.C + j], g, acc[i]);
        }
      }
      const float* dS = dstates + (size_t(bh) * s.NT + n) * (K * V) + col;
      for (int64_t d0 = 0; d0 < K; d0 += kTile) {
        for (int e = w; e < kRowGroup; e += kWarps) {
          const int64_t j = rg + e, d = d0 + lane;
          kt[e][lane] =
              j < c.m && d < K ? kb[j * k.ld + d] * dexp_diff(blast[d], bb[j * W + d]) : 0.0f;
        }
        __syncthreads();
        const int dn = K - d0 < kTile ? int(K - d0) : kTile;
        for (int dd = 0; dd < dn; ++dd) {
          const float x = cin ? dS[(d0 + dd) * V] : 0.0f;
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) acc[i] = fmaf(kt[w + kWarps * i][dd], x, acc[i]);
        }
        __syncthreads();
      }
    }
    if (cin)
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int64_t j = rg + w + kWarps * i;
        if (j < c.m) dv.p[(c.row0 + j) * dv.ld + hk * V + col] = acc[i];
      }
  }
}

// sum_c M[d][c] y_r[c] for this lane's d (row dl of M's 32-row tile, dl = lane) and the thread's 8
// rows r of the group: M is a [K, V] state (row stride V) whose rows d0.. are staged 32 x 32 at a
// time in mt, the rows y_r (row stride ldy, from yb) in yt. Adds into acc in column order.
__device__ __forceinline__ void state_rows(const float* __restrict__ M, int64_t d0, int64_t K,
                                           int64_t V, const float* __restrict__ yb, int64_t ldy,
                                           int64_t rg, int64_t m, float (*mt)[kTile + 1],
                                           float (*yt)[kTile + 1], float (&acc)[kRowsPerThread]) {
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  for (int64_t c0 = 0; c0 < V; c0 += kTile) {
    const int64_t cc = c0 + lane;
    for (int e = w; e < kTile; e += kWarps)
      mt[e][lane] = d0 + e < K && cc < V ? M[(d0 + e) * V + cc] : 0.0f;
    for (int e = w; e < kRowGroup; e += kWarps)
      yt[e][lane] = rg + e < m && cc < V ? yb[(rg + e) * ldy + cc] : 0.0f;
    __syncthreads();
    const int cn = V - c0 < kTile ? int(V - c0) : kTile;
    for (int j = 0; j < cn; ++j) {
      const float x = mt[lane][j];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) acc[i] = fmaf(x, yt[w + kWarps * i][j], acc[i]);
    }
    __syncthreads();
  }
}

// dq of one (sample, query head, chunk, 32 columns of K) per block; row r of the chunk:
//   dq_r[d] = (scale sum_c S_n[d][c] dO_r[c]) e^b_r[d]
//             + sum_{j<=r} ((scale dA[r, j]) k_j[d]) e^(b_r[d] - b_j[d])   (j in order)
// (the CPU's inter part, then its intra terms with every decay element-wise). dq overwritten.
__global__ void __launch_bounds__(kThreads)
    dq_kernel(In k, In dout, const double* __restrict__ bc, const float* __restrict__ dA,
              const float* __restrict__ states, Dims s, Out dq) {
  __shared__ float mt[kTile][kTile + 1];
  __shared__ float yt[kRowGroup][kTile + 1];
  const int64_t K = s.K, V = s.V, W = s.Hkv * s.K;
  const int64_t n = blockIdx.x % s.NT, bh = blockIdx.x / s.NT;
  const int64_t h = bh % s.H, b = bh / s.H, hk = h / s.G;
  const Chunk c = chunk_of(s, b, n);
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int64_t d0 = int64_t(blockIdx.y) * kTile, d = d0 + lane;
  const bool din = d < K;
  const double* bb = bc + c.row0 * W + hk * K;
  const float* kb = k.p + c.row0 * k.ld + hk * K;
  const float* dAb = dA + (bh * s.T + c.t0) * s.C;
  const float* Sn = states + (size_t(bh) * (s.NT + 1) + n) * (K * V);
  for (int64_t rg = 0; rg < c.m; rg += kRowGroup) {
    float acc[kRowsPerThread] = {};
    state_rows(Sn, d0, K, V, dout.p + c.row0 * dout.ld + h * V, dout.ld, rg, c.m, mt, yt, acc);
    double br[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t r = rg + w + kWarps * i;
      br[i] = din && r < c.m ? bb[r * W + d] : 0.0;
      acc[i] = (s.scale * acc[i]) * dexp(__double2float_rn(br[i]));
    }
    const int64_t last = min64(c.m - 1, rg + w + kWarps * (kRowsPerThread - 1));
    for (int64_t j = 0; j <= last; ++j) {
      const float kj = din ? kb[j * k.ld + d] : 0.0f;
      const double bj = din ? bb[j * W + d] : 0.0;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int64_t r = rg + w + kWarps * i;
        if (j <= r && r < c.m)
          acc[i] = fmaf((s.scale * dAb[r * s.C + j]) * kj, dexp_diff(br[i], bj), acc[i]);
      }
    }
    if (din)
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int64_t r = rg + w + kWarps * i;
        if (r < c.m) dq.p[(c.row0 + r) * dq.ld + h * K + d] = acc[i];
      }
  }
}

// dk of one (sample, kv head, chunk, 32 columns of K) per block; row j of the chunk, summed over
// the group's query heads h in order (the CPU adds each head's dk in turn):
//   dk_h,j[d] = (sum_c dS_h[d][c] v_j[c]) e^(b_last[d] - b_j[d])
//               + sum_{r>=j} ((scale dA_h[r, j]) q_h,r[d]) e^(b_r[d] - b_j[d])   (r in order)
// dk overwritten.
__global__ void __launch_bounds__(kThreads)
    dk_kernel(In q, In v, const double* __restrict__ bc, const float* __restrict__ dA,
              const float* __restrict__ dstates, Dims s, Out dk) {
  __shared__ float mt[kTile][kTile + 1];
  __shared__ float yt[kRowGroup][kTile + 1];
  const int64_t K = s.K, V = s.V, W = s.Hkv * s.K;
  const int64_t n = blockIdx.x % s.NT, bk = blockIdx.x / s.NT, hk = bk % s.Hkv, b = bk / s.Hkv;
  const Chunk c = chunk_of(s, b, n);
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  const int64_t d0 = int64_t(blockIdx.y) * kTile, d = d0 + lane;
  const bool din = d < K;
  const double* bb = bc + c.row0 * W + hk * K;
  const double bl = din ? bb[(c.m - 1) * W + d] : 0.0;
  for (int64_t rg = 0; rg < c.m; rg += kRowGroup) {
    double bj[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t j = rg + w + kWarps * i;
      bj[i] = din && j < c.m ? bb[j * W + d] : 0.0;
    }
    float total[kRowsPerThread] = {};
    for (int64_t hh = 0; hh < s.G; ++hh) {
      const int64_t h = hk * s.G + hh, bh = b * s.H + h;
      float acc[kRowsPerThread] = {};
      state_rows(dstates + (size_t(bh) * s.NT + n) * (K * V), d0, K, V,
                 v.p + c.row0 * v.ld + hk * V, v.ld, rg, c.m, mt, yt, acc);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) acc[i] *= dexp_diff(bl, bj[i]);
      const float* qb = q.p + c.row0 * q.ld + h * K;
      const float* dAb = dA + (bh * s.T + c.t0) * s.C;
      for (int64_t r = rg + w; r < c.m; ++r) {
        const float qr = din ? qb[r * q.ld + d] : 0.0f;
        const double br = din ? bb[r * W + d] : 0.0;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int64_t j = rg + w + kWarps * i;
          if (j <= r)
            acc[i] = fmaf((s.scale * dAb[r * s.C + j]) * qr, dexp_diff(br, bj[i]), acc[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) total[i] += acc[i];
    }
    if (din)
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int64_t j = rg + w + kWarps * i;
        if (j < c.m) dk.p[(c.row0 + j) * dk.ld + hk * K + d] = total[i];
      }
  }
}

// dgk of one (sample, kv head, chunk) per block. First rs[d] = sum over the group's heads (in
// order) of rowsum(S_h,[n+1] dS_h)[d] (one warp per d, a butterfly over V: a fixed order), then one
// thread per d walks the rows from the last: acc += sum_h q_h,r dq_h,r - k_r dk_r, dgk_r = acc.
// Reads this call's dq and dk (complete: earlier kernels on the stream). dgk overwritten.
__global__ void __launch_bounds__(kThreads)
    dgk_kernel(In q, In k, In dq, In dk, const float* __restrict__ states,
               const float* __restrict__ dstates, Dims s, Out dgk) {
  extern __shared__ __align__(16) float dyn_smem[];
  float* rs = dyn_smem;  // [K]
  const int64_t K = s.K, V = s.V;
  const int64_t n = blockIdx.x % s.NT, bk = blockIdx.x / s.NT, hk = bk % s.Hkv, b = bk / s.Hkv;
  const Chunk c = chunk_of(s, b, n);
  const int lane = int(threadIdx.x) % 32, w = int(threadIdx.x) / 32;
  for (int64_t d = w; d < K; d += kWarps) {
    float sum = 0.0f;
    for (int64_t hh = 0; hh < s.G; ++hh) {
      const int64_t bh = b * s.H + hk * s.G + hh;
      const float* Sp = states + (size_t(bh) * (s.NT + 1) + n + 1) * (K * V) + d * V;
      const float* Dp = dstates + (size_t(bh) * s.NT + n) * (K * V) + d * V;
      float part = 0.0f;
      for (int64_t x = lane; x < V; x += 32) part = fmaf(Sp[x], Dp[x], part);
      sum += warp_sum(part);
    }
    if (lane == 0) rs[d] = sum;
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < K; d += kThreads) {
    float acc = rs[d];
    for (int64_t r = c.m - 1; r >= 0; --r) {
      const int64_t row = c.row0 + r;
      float x = 0.0f;
      for (int64_t hh = 0; hh < s.G; ++hh) {
        const int64_t h = hk * s.G + hh;
        x = fmaf(q.p[row * q.ld + h * K + d], dq.p[row * dq.ld + h * K + d], x);
      }
      x = fmaf(-k.p[row * k.ld + hk * K + d], dk.p[row * dk.ld + hk * K + d], x);
      acc += x;
      dgk.p[row * dgk.ld + hk * K + d] = acc;
    }
  }
}

// ---- state passing -----------------------------------------------------------------------------

// decay[b, i] = sum_t gk[b*T + t, i] in token order (the CPU's: 0, then += each row).
__global__ void __launch_bounds__(kThreads)
    decay_total_kernel(int64_t B, int64_t T, int64_t W, const float* __restrict__ gk,
                       float* __restrict__ decay) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < B * W; e += step) {
    const int64_t b = e / W, i = e % W;
    const float* g = gk + b * T * W + i;
    float acc = 0.0f;
#pragma unroll 8
    for (int64_t t = 0; t < T; ++t) acc += g[t * W];
    decay[e] = acc;
  }
}

// S[b, h, i, j] = e^decay[b, h / G, i] S + E (one fused multiply-add, as the CPU's vector loop).
__global__ void __launch_bounds__(kThreads)
    state_fold_kernel(int64_t n, int64_t H, int64_t Hkv, int64_t K, int64_t V,
                      const float* __restrict__ decay, const float* __restrict__ E,
                      float* __restrict__ S) {
  const int64_t G = H / Hkv, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += step) {
    const int64_t i = (e / V) % K, bh = e / (V * K), h = bh % H, b = bh / H;
    S[e] = fmaf(dexp(decay[(b * Hkv + h / G) * K + i]), S[e], E[e]);
  }
}

// ---- host side ---------------------------------------------------------------------------------

// Launches kernel<<<grid, kThreads, smem>>> on the compute stream (asking for more than 48 KiB of
// dynamic shared memory where needed) and checks the launch.
template <class... P, class... A>
void launch(const char* op, void (*kernel)(P...), dim3 grid, size_t smem, A... args) {
  if (smem > 48 * 1024)
    LOOM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), op);
  kernel<<<grid, kThreads, smem, stream()>>>(args...);
  check_launch(op);
}

size_t max_smem(const char* op) {
  int dev = 0, v = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&dev), op);
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), op);
  return size_t(v);
}

void check_ld(const char* what, const char* name, int64_t ld, int64_t width) {
  LOOM_CHECK(ld == 0 || ld >= width, what, ": row stride of ", name, " is ", ld,
             ", expected 0 (contiguous) or >= ", width);
}

// The CPU's checks (kernels/cpu/gla.cpp), then what the kernels need: pointers, K within the
// shared memory of a sweep block, launch sizes.
void check_args(const char* what, const GlaCore& a) {
  cpu::check_gla_args(what, a);
  if (a.B == 0) return;
  const size_t need = sweep_smem(a.K), have = max_smem(what);
  LOOM_CHECK(need <= have, what, ": head dim K ", a.K, " needs ", need,
             " bytes of shared memory per block for the state, the GPU has ", have);
  // Grid x: B*H*NT (scores, dq), B*H*ceil(V/32) (sweeps); y: the tile pairs of a chunk, the
  // 32-column tiles of K and V, the cumsum's 256 columns of Hkv*K.
  const int64_t NT = (a.T + a.chunk - 1) / a.chunk;
  const int64_t nvs = (a.V + kTile - 1) / kTile, nkt = (a.K + kTile - 1) / kTile;
  const int64_t tiles = (a.chunk + kTile - 1) / kTile;
  LOOM_CHECK(a.B * a.H * std::max(NT, nvs) <= INT_MAX && tiles * (tiles + 1) / 2 <= 65535 &&
                 std::max(nvs, nkt) <= 65535 && a.Hkv * a.K / kThreads < 65535,
             what, ": B ", a.B, " T ", a.T, " H ", a.H, " Hkv ", a.Hkv, " K ", a.K, " V ", a.V,
             " chunk ", a.chunk, " is more than one launch covers");
}

Dims dims_of(const GlaCore& a) {
  Dims s;
  s.B = a.B, s.T = a.T, s.H = a.H, s.Hkv = a.Hkv, s.K = a.K, s.V = a.V;
  s.C = a.chunk, s.NT = (a.T + a.chunk - 1) / a.chunk, s.G = a.H / a.Hkv;
  s.scale = a.scale;
  return s;
}
In in(const GlaIn& x, int64_t width) {
  return {x.p, x.ld ? x.ld : width};
}
Out out(const GlaOut& x, int64_t width) {
  return {x.p, x.ld ? x.ld : width};
}

// The call's scratch blocks, as kernels/cuda/scratch.hpp sizes them (a meta run books the same):
// doubles as f32 pairs (Tensor has no f64; the allocator's blocks are aligned for any type).
std::vector<ScratchBlock> scratch_of(const Dims& s, bool backward) {
  return gla_core_scratch(s.B, s.T, s.H, s.Hkv, s.K, s.V, s.C, backward);
}
float* floats(Tensor& t, const ScratchBlock& b) {
  t = Tensor::empty({b.numel}, b.dtype, Device::cuda);
  return t.data<float>();
}
double* doubles(Tensor& t, const ScratchBlock& b) {
  return reinterpret_cast<double*>(floats(t, b));
}

// b (the chunk-local cumsum) and A = the decayed scores, the forward's and the backward's first
// steps.
void cumsum_and_scores(const char* op, const GlaCore& a, const Dims& s, double* bc, float* A) {
  const In q = in(a.q, a.H * a.K), k = in(a.k, a.Hkv * a.K), gk = in(a.gk, a.Hkv * a.K);
  launch(op, cumsum_kernel, dim3(unsigned(s.B * s.NT), blocks_for(s.Hkv * s.K, kThreads)), 0, gk, s,
         bc);
  const int64_t tiles = (s.C + kTile - 1) / kTile;
  launch(op, scores_kernel<true>,
         dim3(unsigned(s.B * s.H * s.NT), unsigned(tiles * (tiles + 1) / 2)), 0, q, k,
         static_cast<const double*>(bc), s, s.K, s.scale, A);
}

}  // namespace

void gla_forward(const GlaCore& a, GlaOut o, float* ht) {
  const char* op = "gla_forward";
  check_args(op, a);
  check_ld(op, "o", o.ld, a.H * a.V);
  if (a.B == 0) return;
  LOOM_CHECK(a.T == 0 || (a.q.p && a.k.p && a.v.p && a.gk.p && o.p), op,
             ": null pointer among q, k, v, gk, o");
  if (a.T == 0 && !ht) return;
  const Dims s = dims_of(a);
  Tensor bbuf, abuf;
  double* bc = nullptr;
  float* A = nullptr;
  if (s.T > 0) {
    const std::vector<ScratchBlock> sb = scratch_of(s, false);
    bc = doubles(bbuf, sb[0]);
    A = floats(abuf, sb[1]);
    cumsum_and_scores(op, a, s, bc, A);
  }
  const int64_t nvs = (s.V + kTile - 1) / kTile;
  launch(op, forward_sweep_kernel, dim3(unsigned(s.B * s.H * nvs)), sweep_smem(s.K),
         in(a.q, a.H * a.K), in(a.k, a.Hkv * a.K), in(a.v, a.Hkv * a.V),
         static_cast<const double*>(bc), static_cast<const float*>(A), a.h0, s,
         s.T > 0 ? out(o, a.H * a.V) : Out{nullptr, 0}, ht, static_cast<float*>(nullptr));
}

void gla_backward(const GlaCore& a, GlaIn dout, const float* dht, const GlaCoreGrads& g) {
  const char* op = "gla_backward";
  check_args(op, a);
  check_ld(op, "dout", dout.ld, a.H * a.V);
  check_ld(op, "dq", g.dq.ld, a.H * a.K);
  check_ld(op, "dk", g.dk.ld, a.Hkv * a.K);
  check_ld(op, "dv", g.dv.ld, a.Hkv * a.V);
  check_ld(op, "dgk", g.dgk.ld, a.Hkv * a.K);
  if (a.B == 0) return;
  LOOM_CHECK(a.T == 0 || (a.q.p && a.k.p && a.v.p && a.gk.p && dout.p && g.dq.p && g.dk.p &&
                          g.dv.p && g.dgk.p),
             op, ": null pointer among q, k, v, gk, dout, dq, dk, dv, dgk");
  const Dims s = dims_of(a);
  const int64_t nvs = (s.V + kTile - 1) / kTile, nkt = (s.K + kTile - 1) / kTile;
  const In q = in(a.q, a.H * a.K), k = in(a.k, a.Hkv * a.K), v = in(a.v, a.Hkv * a.V);
  const In dO = in(dout, a.H * a.V);
  if (s.T == 0) {  // no tokens: dh0 = dht (or 0), as the CPU
    if (g.dh0)
      launch(op, backward_sweep_kernel, dim3(unsigned(s.B * s.H * nvs)), sweep_smem(s.K), q, dO,
             static_cast<const double*>(nullptr), dht, s, static_cast<float*>(nullptr), g.dh0);
    return;
  }
  Tensor bbuf, abuf, dabuf, sbuf, dsbuf;
  const std::vector<ScratchBlock> sb = scratch_of(s, true);
  double* bc = doubles(bbuf, sb[0]);
  float* A = floats(abuf, sb[1]);
  float* dA = floats(dabuf, sb[2]);
  float* states = floats(sbuf, sb[3]);
  float* dstates = floats(dsbuf, sb[4]);
  cumsum_and_scores(op, a, s, bc, A);
  const int64_t tiles = (s.C + kTile - 1) / kTile;
  launch(op, scores_kernel<false>,
         dim3(unsigned(s.B * s.H * s.NT), unsigned(tiles * (tiles + 1) / 2)), 0, dO, v,
         static_cast<const double*>(bc), s, s.V, 1.0f, dA);
  const double* cbc = bc;
  launch(op, forward_sweep_kernel, dim3(unsigned(s.B * s.H * nvs)), sweep_smem(s.K), q, k, v, cbc,
         static_cast<const float*>(A), a.h0, s, Out{nullptr, 0}, static_cast<float*>(nullptr),
         states);
  launch(op, backward_sweep_kernel, dim3(unsigned(s.B * s.H * nvs)), sweep_smem(s.K), q, dO, cbc,
         dht, s, dstates, g.dh0);
  const Out dq = out(g.dq, a.H * a.K), dk = out(g.dk, a.Hkv * a.K), dv = out(g.dv, a.Hkv * a.V);
  launch(op, dv_kernel, dim3(unsigned(s.B * s.Hkv * s.NT), unsigned(nvs)), 0, k, dO, cbc,
         static_cast<const float*>(A), static_cast<const float*>(dstates), s, dv);
  launch(op, dq_kernel, dim3(unsigned(s.B * s.H * s.NT), unsigned(nkt)), 0, k, dO, cbc,
         static_cast<const float*>(dA), static_cast<const float*>(states), s, dq);
  launch(op, dk_kernel, dim3(unsigned(s.B * s.Hkv * s.NT), unsigned(nkt)), 0, q, v, cbc,
         static_cast<const float*>(dA), static_cast<const float*>(dstates), s, dk);
  launch(op, dgk_kernel, dim3(unsigned(s.B * s.Hkv * s.NT)), sizeof(float) * size_t(s.K), q, k,
         In{dq.p, dq.ld}, In{dk.p, dk.ld}, static_cast<const float*>(states),
         static_cast<const float*>(dstates), s, out(g.dgk, a.Hkv * a.K));
}

void gla_decay_total(int64_t B, int64_t T, int64_t Hkv, int64_t K, const float* gk, float* decay) {
  LOOM_CHECK(B >= 0 && T >= 0 && Hkv > 0 && K > 0, "gla_decay_total: bad shape B ", B, " T ", T,
             " Hkv ", Hkv, " K ", K);
  if (B == 0) return;
  LOOM_CHECK(decay && (T == 0 || gk), "gla_decay_total: null pointer among gk, decay");
  const int64_t n = B * Hkv * K;
  launch("gla_decay_total", decay_total_kernel, dim3(std::min(blocks_for(n, kThreads), kMaxBlocks)),
         0, B, T, Hkv * K, gk, decay);
}

void gla_state_fold(int64_t B, int64_t H, int64_t Hkv, int64_t K, int64_t V, const float* decay,
                    const float* E, float* S) {
  LOOM_CHECK(B >= 0 && H > 0 && Hkv > 0 && H % Hkv == 0 && K > 0 && V > 0,
             "gla_state_fold: bad shape B ", B, " H ", H, " Hkv ", Hkv, " K ", K, " V ", V);
  if (B == 0) return;
  LOOM_CHECK(decay && E && S, "gla_state_fold: null pointer among decay, E, S");
  const int64_t n = B * H * K * V;
  launch("gla_state_fold", state_fold_kernel, dim3(std::min(blocks_for(n, kThreads), kMaxBlocks)),
         0, n, H, Hkv, K, V, decay, E, S);
}

}  // namespace loom::cuda
