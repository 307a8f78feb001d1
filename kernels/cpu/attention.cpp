#include "kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include <omp.h>

#include "core/error.hpp"
#include "kernels/cpu/vec_math.hpp"

// The 64-byte vector type v16 (vec_math.hpp) is handled as two or four registers when AVX-512 is
// off (LOOM_NATIVE=OFF); GCC then warns that the ABI of functions passing it differs, which does
// not matter for functions internal to this file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loom::cpu {
namespace {

inline v16 vmax(v16 a, v16 b) {
  return a > b ? a : b;
}
// Loads a vector that several FMAs reuse. Without the empty asm GCC folds the load into every
// FMA as a memory operand, so the kernels below would issue R loads per vector instead of one
// and become load-bound.
inline v16 load_reg(const float* p) {
  v16 x = load(p);
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#endif
  return x;
}

// Sum of a[i]*b[i], vectorized (a plain loop would be summed in order, one add at a time).
inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc{};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc += load(a + i) * load(b + i);
  float sum = 0;
  for (int l = 0; l < kW; ++l) sum += acc[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// 16x16 transpose in registers: stage K swaps bit K of the row index with bit K of the column
// index, one two-source shuffle per row.
constexpr int transpose_index(int k, bool upper, int c) {
  const bool hi = (c >> k) & 1;
  return upper ? (hi ? kW + c : c + (1 << k)) : (hi ? kW + c - (1 << k) : c);
}
template <int K, bool Upper, int... C>
constexpr v16i transpose_mask(std::integer_sequence<int, C...>) {
  return v16i{transpose_index(K, Upper, C)...};
}
template <int K>
inline void transpose_stage(v16* x) {
  constexpr v16i lo = transpose_mask<K, false>(std::make_integer_sequence<int, kW>());
  constexpr v16i hi = transpose_mask<K, true>(std::make_integer_sequence<int, kW>());
  for (int r = 0; r < kW; ++r) {
    if ((r >> K) & 1) continue;
    const v16 a = x[r], b = x[r + (1 << K)];
    x[r] = __builtin_shuffle(a, b, lo);
    x[r + (1 << K)] = __builtin_shuffle(a, b, hi);
  }
}

// dst[c*ldd + r] = src[r*lds + c] * mul for r < rows, c < cols; columns [rows, rpad) of dst are
// zero (rpad a multiple of 16).
void transpose_tile(const float* src, int64_t lds, int64_t rows, int64_t rpad, int64_t cols,
                    float* dst, int64_t ldd, float mul) {
  for (int64_t r0 = 0; r0 < rpad; r0 += kW) {
    int64_t c0 = 0;
    for (; c0 + kW <= cols; c0 += kW) {
      v16 x[kW];
      for (int i = 0; i < kW; ++i)
        x[i] = r0 + i < rows ? load(src + (r0 + i) * lds + c0) * mul : v16{};
      transpose_stage<0>(x);
      transpose_stage<1>(x);
      transpose_stage<2>(x);
      transpose_stage<3>(x);
      for (int i = 0; i < kW; ++i) store(dst + (c0 + i) * ldd + r0, x[i]);
    }
    for (; c0 < cols; ++c0)
      for (int64_t i = 0; i < kW; ++i)
        dst[c0 * ldd + r0 + i] = r0 + i < rows ? src[(r0 + i) * lds + c0] * mul : 0.0f;
  }
}

// Query and key tile sizes. The score kernels dispatch on up to 4 vectors of a tile row.
constexpr int64_t kBq = 64, kBk = 64;
static_assert(kBq % kW == 0 && kBk % kW == 0 && kBq <= 4 * kW && kBk <= 4 * kW);

// ---- "score" products: C[r][16v + c] = sum_d A[r*lda + d] * BT[d*ldb + 16v + c] -------------
// Rows of A are read as scalars (broadcast), BT is a transposed tile whose rows are vectors; the
// reduction runs over the head dim, whatever it is.
struct Score {
  const float* A;
  int64_t lda;
  const float* BT;
  int64_t ldb;
  float* C;
  int64_t ldc;
  int64_t D;
};

template <int R, int NV>
inline void score_kernel(const float* A, int64_t lda, const float* BT, int64_t ldb, int64_t D,
                         float* C, int64_t ldc) {
  v16 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = v16{};
  for (int64_t d = 0; d < D; ++d) {
    v16 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load_reg(BT + d * ldb + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = A[r * lda + d];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kW, acc[r][v]);
}

template <int R>
inline void score_block(const Score& s, int64_t r, int64_t v0, int64_t v1) {
  const float* A = s.A + r * s.lda;
  const float* BT = s.BT + v0 * kW;
  float* C = s.C + r * s.ldc + v0 * kW;
  switch (v1 - v0) {
    case 1:
      score_kernel<R, 1>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
      break;
    case 2:
      score_kernel<R, 2>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
      break;
    case 3:
      score_kernel<R, 3>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
      break;
    case 4:
      score_kernel<R, 4>(A, s.lda, BT, s.ldb, s.D, C, s.ldc);
      break;
    default:
      break;
  }
}

// Rows [0, rows) in blocks of 4; vrange(r0, r1) gives the vectors [v0, v1) that rows r0..r1-1
// need (the causal mask lets the kernel skip the rest).
template <class VRange>
void scores(const Score& s, int64_t rows, VRange vrange) {
  constexpr int R = 4;
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    const auto [v0, v1] = vrange(r, r + R);
    if (v0 < v1) score_block<R>(s, r, v0, v1);
  }
  for (; r < rows; ++r) {
    const auto [v0, v1] = vrange(r, r + 1);
    if (v0 < v1) score_block<1>(s, r, v0, v1);
  }
}

// ---- "accumulate" products: C[r][:D] += sum_k A[r*sr + k*sk] * B[k*ldb + :D] ----------------
// The coefficient is broadcast from any layout (sr, sk), rows of B and C are vectors over the
// head dim. ND = D/16 selects the unrolled kernel; ND = 0 is the generic path for other D.
struct Accum {
  const float* A;
  int64_t sr, sk;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  int64_t D;
  const float* row_scale = nullptr;  // if set, C[r] *= row_scale[r] first (online softmax)
};

template <int R, int ND>
inline void accum_kernel(const float* A, int64_t sr, int64_t sk, const float* B, int64_t ldb,
                         int64_t lo, int64_t hi, float* C, int64_t ldc, const float* row_scale) {
  v16 acc[R][ND];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float rs = row_scale ? row_scale[r] : 1.0f;
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) acc[r][v] = load(C + r * ldc + v * kW) * rs;
  }
  for (int64_t k = lo; k < hi; ++k) {
    v16 b[ND];
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) b[v] = load_reg(B + k * ldb + v * kW);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = A[r * sr + k * sk];
#pragma GCC unroll 8
      for (int v = 0; v < ND; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) store(C + r * ldc + v * kW, acc[r][v]);
}

inline void accum_generic(const Accum& a, int64_t r, int64_t lo, int64_t hi) {
  float* c = a.C + r * a.ldc;
  if (a.row_scale)
    for (int64_t d = 0; d < a.D; ++d) c[d] *= a.row_scale[r];
  for (int64_t k = lo; k < hi; ++k) {
    const float coef = a.A[r * a.sr + k * a.sk];
    const float* b = a.B + k * a.ldb;
    for (int64_t d = 0; d < a.D; ++d) c[d] += coef * b[d];
  }
}

// Rows [0, rows); krange(r0, r1) gives the reduction range [lo, hi) that rows r0..r1-1 need.
// Row blocks keep R*ND accumulators near 16..24 of the 32 vector registers.
template <int ND, class KRange>
void accumulate(const Accum& a, int64_t rows, KRange krange) {
  if constexpr (ND == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      const auto [lo, hi] = krange(r, r + 1);
      accum_generic(a, r, lo, hi);
    }
  } else {
    constexpr int R = ND <= 3 ? 8 : ND <= 6 ? 4 : 2;
    int64_t r = 0;
    for (; r + R <= rows; r += R) {
      const auto [lo, hi] = krange(r, r + R);
      if (lo < hi || a.row_scale)
        accum_kernel<R, ND>(a.A + r * a.sr, a.sr, a.sk, a.B, a.ldb, lo, hi, a.C + r * a.ldc, a.ldc,
                            a.row_scale ? a.row_scale + r : nullptr);
    }
    for (; r < rows; ++r) {
      const auto [lo, hi] = krange(r, r + 1);
      if (lo < hi || a.row_scale)
        accum_kernel<1, ND>(a.A + r * a.sr, a.sr, a.sk, a.B, a.ldb, lo, hi, a.C + r * a.ldc, a.ldc,
                            a.row_scale ? a.row_scale + r : nullptr);
    }
  }
}

// Per-thread scratch, allocated once per call and 64-byte aligned.
struct alignas(64) Line {
  float f[kW];
};
class Scratch {
 public:
  explicit Scratch(int64_t floats) : buf_(std::make_unique<Line[]>((floats + kW - 1) / kW)) {}
  float* take(int64_t floats) {  // consecutive pieces, each starting on a cache line
    float* p = buf_[used_].f;
    used_ += (floats + kW - 1) / kW;
    return p;
  }

 private:
  std::unique_ptr<Line[]> buf_;
  int64_t used_ = 0;
};
inline int64_t lines(int64_t floats) {
  return (floats + kW - 1) / kW * kW;
}

void check_shape(const AttentionShape& s, const char* who) {
  LOOM_CHECK(s.B > 0 && s.T > 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0, who,
             ": B, T, Hq, Hkv, D must be positive, got B=", s.B, " T=", s.T, " Hq=", s.Hq,
             " Hkv=", s.Hkv, " D=", s.D);
  LOOM_CHECK(s.Hq % s.Hkv == 0, who, ": Hq (", s.Hq, ") must be a multiple of Hkv (", s.Hkv, ")");
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, who, ": q_stride (", s.q_stride, ") must be >= Hq*D (",
             s.Hq * s.D, ")");
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, who, ": kv_stride (", s.kv_stride, ") must be >= Hkv*D (",
             s.Hkv * s.D, ")");
  LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0, who, ": scale must be finite and > 0, got ",
             s.scale);
}

template <int ND>
void forward_impl(const AttentionShape& s, const float* q, const float* k, const float* v,
                  float* out, float* lse) {
  const int64_t B = s.B, T = s.T, Hq = s.Hq, D = s.D, G = s.Hq / s.Hkv;
  const int64_t qs = s.q_stride, kvs = s.kv_stride;
  const int64_t nqt = (T + kBq - 1) / kBq;
  const int64_t units = B * Hq * nqt;
  // Scores live in base-2 units: q is pre-scaled by scale*log2(e) so that exp becomes exp2.
  const float c = s.scale * kLog2e;
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel
  {
    Scratch scratch(lines(D * kBq) + lines(kBk * kBq) + lines(kBq * D) + 3 * kBq);
    float* qt = scratch.take(D * kBq);    // Q^T of the tile, [D][kBq]
    float* st = scratch.take(kBk * kBq);  // S^T then P^T of a tile pair, [kBk][kBq]
    float* o = scratch.take(kBq * D);     // unnormalized output rows, [kBq][D]
    float* m = scratch.take(kBq);         // running max (base 2)
    float* l = scratch.take(kBq);         // running sum
    float* alpha = scratch.take(kBq);     // rescale factor of the current key tile
    // The last query tiles have the most key tiles: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t qi = nqt - 1 - u % nqt;
      const int64_t b = u / nqt / Hq, h = u / nqt % Hq, g = h / G;
      const int64_t q0 = qi * kBq, nq = std::min(kBq, T - q0);
      const int64_t nvq = (nq + kW - 1) / kW;
      const float* qb = q + (b * T + q0) * qs + h * D;
      transpose_tile(qb, qs, nq, nvq * kW, D, qt, kBq, c);
      std::fill(m, m + kBq, neg_inf);
      std::fill(l, l + kBq, 0.0f);
      std::fill(o, o + nq * D, 0.0f);
      for (int64_t k0 = 0; k0 < q0 + nq; k0 += kBk) {
        const int64_t nk = std::min(kBk, T - k0);
        const int64_t off = k0 - q0;  // key j sees query i iff j + off <= i
        const float* kb = k + (b * T + k0) * kvs + g * D;
        const float* vb = v + (b * T + k0) * kvs + g * D;
        scores(Score{kb, kvs, qt, kBq, st, kBq, D}, nk, [&](int64_t r0, int64_t) {
          const int64_t v0 = std::min(std::max<int64_t>(0, r0 + off) / kW, nvq);
          return std::pair<int64_t, int64_t>(v0, nvq);
        });
        if (nk - 1 + off > 0) {
          for (int64_t j = 0; j < nk; ++j) {
            const int64_t lim = std::min(j + off, nvq * kW);
            for (int64_t i = 0; i < lim; ++i) st[j * kBq + i] = neg_inf;
          }
        }
        // Online softmax, vectorized over 16 queries at a time. Key 0 is in the first key tile
        // and visible to every query, so the running max is finite from then on.
        for (int64_t vq = 0; vq < nvq; ++vq) {
          float* col = st + vq * kW;
          v16 mt = load(col);
          for (int64_t j = 1; j < nk; ++j) mt = vmax(mt, load(col + j * kBq));
          const v16 mo = load(m + vq * kW);
          const v16 mn = vmax(mo, mt);
          const v16 al = vexp2(mo - mn);
          v16 sum{};
          for (int64_t j = 0; j < nk; ++j) {
            const v16 p = vexp2(load(col + j * kBq) - mn);
            store(col + j * kBq, p);
            sum += p;
          }
          store(l + vq * kW, load(l + vq * kW) * al + sum);
          store(m + vq * kW, mn);
          store(alpha + vq * kW, al);
        }
        // O = alpha * O + P V; on the first key tile O is zero and alpha is not needed.
        accumulate<ND>(Accum{st, 1, kBq, vb, kvs, o, D, D, k0 > 0 ? alpha : nullptr}, nq,
                       [&](int64_t, int64_t r1) {
                         return std::pair<int64_t, int64_t>(0, std::min(nk, r1 - off));
                       });
      }
      for (int64_t i = 0; i < nq; ++i) {
        const float inv = 1.0f / l[i];
        float* orow = out + ((b * T + q0 + i) * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = o[i * D + d] * inv;
        lse[(b * Hq + h) * T + q0 + i] = (m[i] + std::log2(l[i])) * kLn2;
      }
    }
  }
}

// Backward. The scores of one (query tile, key tile) pair are recomputed from q, k and lse,
// then feed five products: dV += P^T dO, dK += dS^T Q, dQ += dS K (and S, dP themselves).
//
// Work is split so that every output element has a single writer and a summation order that
// does not depend on the number of threads:
//  - fused scheme, units (batch, kv group): a unit owns dk/dv of the group and dq of the group's
//    heads, and walks key tiles in order, adding each tile's dq contribution in place;
//  - split scheme, for when there are too few (batch, kv group) units to feed the threads:
//    units (batch, kv group, key tile) compute dk/dv, then units (batch, head, query tile)
//    recompute P and dS to compute dq, walking key tiles in the same order. This costs the two
//    score products and the exp again (about +40% FLOPs) but parallelizes over tiles.
// Both run the same kernels in the same order for each output element, so the results are
// bit-identical whichever scheme (and thread count) is used.
template <int ND>
class Backward {
 public:
  Backward(const AttentionShape& s, const float* q, const float* k, const float* v,
           const float* lse, const float* dout, const float* di, float* dq, float* dk, float* dv)
      : B(s.B),
        T(s.T),
        Hq(s.Hq),
        Hkv(s.Hkv),
        D(s.D),
        G(s.Hq / s.Hkv),
        qs(s.q_stride),
        kvs(s.kv_stride),
        os(s.Hq * s.D),
        c(s.scale * kLog2e),
        scale(s.scale),
        q(q),
        k(k),
        v(v),
        lse(lse),
        dout(dout),
        di(di),
        dq(dq),
        dk(dk),
        dv(dv) {}

  // Per-thread scratch.
  struct Buffers {
    explicit Buffers(int64_t D)
        : mem(2 * lines(D * kBk) + 2 * lines(kBq * kBk) + 2 * lines(kBk * D)),
          kt(mem.take(D * kBk)),
          vt(mem.take(D * kBk)),
          p(mem.take(kBq * kBk)),
          ds(mem.take(kBq * kBk)),
          dkacc(mem.take(kBk * D)),
          dvacc(mem.take(kBk * D)) {}
    Scratch mem;
    float* kt;     // K^T of the key tile, [D][kBk]
    float* vt;     // V^T
    float* p;      // S then P, [kBq][kBk]
    float* ds;     // dP then dS (times scale)
    float* dkacc;  // [kBk][D]
    float* dvacc;
  };

  int64_t key_tiles() const { return (T + kBk - 1) / kBk; }
  int64_t query_tiles() const { return (T + kBq - 1) / kBq; }

  // dk/dv of key tile k0 of (b, g), summed over the group's heads and all query tiles that see
  // it; with_dq also adds this key tile's contribution to dq (fused scheme).
  void key_tile(Buffers& w, int64_t b, int64_t g, int64_t k0, bool with_dq) const {
    const int64_t nk = std::min(kBk, T - k0);
    const float* kb = k + (b * T + k0) * kvs + g * D;
    const float* vb = v + (b * T + k0) * kvs + g * D;
    transpose_tile(kb, kvs, nk, kBk, D, w.kt, kBk, 1.0f);
    transpose_tile(vb, kvs, nk, kBk, D, w.vt, kBk, 1.0f);
    std::fill(w.dkacc, w.dkacc + nk * D, 0.0f);
    std::fill(w.dvacc, w.dvacc + nk * D, 0.0f);
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t h = g * G + hh;
      for (int64_t q0 = k0 / kBq * kBq; q0 < T; q0 += kBq) {
        const int64_t nq = std::min(kBq, T - q0);
        const int64_t off = k0 - q0;
        const float* qb = q + (b * T + q0) * qs + h * D;
        const float* dob = dout + (b * T + q0) * os + h * D;
        probs_and_grads(w, b, h, q0, nq, k0, nk);
        // Key j is seen by queries [max(0, j + off), nq).
        const auto query_range = [&](int64_t r0, int64_t) {
          return std::pair<int64_t, int64_t>(std::max<int64_t>(0, r0 + off), nq);
        };
        accumulate<ND>(Accum{w.p, 1, kBk, dob, os, w.dvacc, D, D}, nk, query_range);
        accumulate<ND>(Accum{w.ds, 1, kBk, qb, qs, w.dkacc, D, D}, nk, query_range);
        if (with_dq) add_dq(w, b, h, q0, nq, k0, nk);
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      std::copy_n(w.dkacc + j * D, D, dk + (b * T + k0 + j) * kvs + g * D);
      std::copy_n(w.dvacc + j * D, D, dv + (b * T + k0 + j) * kvs + g * D);
    }
  }

  // dq of query tile q0 of head h (split scheme), from all key tiles in order.
  void query_tile(Buffers& w, int64_t b, int64_t h, int64_t q0) const {
    const int64_t nq = std::min(kBq, T - q0), g = h / G;
    for (int64_t i = 0; i < nq; ++i) std::fill_n(dq + (b * T + q0 + i) * qs + h * D, D, 0.0f);
    for (int64_t k0 = 0; k0 < q0 + nq; k0 += kBk) {
      const int64_t nk = std::min(kBk, T - k0);
      transpose_tile(k + (b * T + k0) * kvs + g * D, kvs, nk, kBk, D, w.kt, kBk, 1.0f);
      transpose_tile(v + (b * T + k0) * kvs + g * D, kvs, nk, kBk, D, w.vt, kBk, 1.0f);
      probs_and_grads(w, b, h, q0, nq, k0, nk);
      add_dq(w, b, h, q0, nq, k0, nk);
    }
  }

  // Zeroes the dq rows of (b, g)'s heads (the fused scheme accumulates into them).
  void zero_dq(int64_t b, int64_t g) const {
    for (int64_t t = 0; t < T; ++t) std::fill_n(dq + (b * T + t) * qs + g * G * D, G * D, 0.0f);
  }

  const int64_t B, T, Hq, Hkv, D, G, qs, kvs, os;

 private:
  // P (masked, exact zeros outside the causal window) into w.p and dS * scale into w.ds.
  void probs_and_grads(Buffers& w, int64_t b, int64_t h, int64_t q0, int64_t nq, int64_t k0,
                       int64_t nk) const {
    const int64_t off = k0 - q0;  // key j sees query i iff j + off <= i
    const float* qb = q + (b * T + q0) * qs + h * D;
    const float* dob = dout + (b * T + q0) * os + h * D;
    // Keys [0, min(nk, i - off + 1)) are visible to query i.
    const auto key_vectors = [&](int64_t, int64_t r1) {
      const int64_t hi = std::min(nk, r1 - off);
      return std::pair<int64_t, int64_t>(0, hi > 0 ? (hi + kW - 1) / kW : 0);
    };
    scores(Score{qb, qs, w.kt, kBk, w.p, kBk, D}, nq, key_vectors);
    scores(Score{dob, os, w.vt, kBk, w.ds, kBk, D}, nq, key_vectors);
    v16i iota;
    for (int l = 0; l < kW; ++l) iota[l] = l;
    const float* lrow = lse + (b * Hq + h) * T + q0;
    const float* drow = di + (b * Hq + h) * T + q0;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t lim = std::min(nk, i - off + 1);
      const int64_t nv = lim > 0 ? (lim + kW - 1) / kW : 0;
      const float l2 = lrow[i] * kLog2e, dval = drow[i];
      float* prow = w.p + i * kBk;
      float* dsrow = w.ds + i * kBk;
      for (int64_t vk = 0; vk < nv; ++vk) {
        const v16i visible = iota + int32_t(vk * kW) < int32_t(lim);
        v16 pv = vexp2(load(prow + vk * kW) * c - l2);
        pv = visible ? pv : v16{};
        store(prow + vk * kW, pv);
        store(dsrow + vk * kW, pv * (load(dsrow + vk * kW) - dval) * scale);
      }
      for (int64_t vk = nv; vk < kBk / kW; ++vk) {
        store(prow + vk * kW, v16{});
        store(dsrow + vk * kW, v16{});
      }
    }
  }

  // dq[q0 + i] += sum_j dS[i][j] k[k0 + j], for the keys query i sees.
  void add_dq(Buffers& w, int64_t b, int64_t h, int64_t q0, int64_t nq, int64_t k0,
              int64_t nk) const {
    const int64_t off = k0 - q0;
    const float* kb = k + (b * T + k0) * kvs + (h / G) * D;
    float* dqb = dq + (b * T + q0) * qs + h * D;
    accumulate<ND>(Accum{w.ds, kBk, 1, kb, kvs, dqb, qs, D}, nq, [&](int64_t, int64_t r1) {
      return std::pair<int64_t, int64_t>(0, std::min(nk, r1 - off));
    });
  }

  const float c, scale;
  const float *q, *k, *v, *lse, *dout, *di;
  float *dq, *dk, *dv;
};

template <int ND>
void backward_impl(const AttentionShape& s, const float* q, const float* k, const float* v,
                   const float* out, const float* lse, const float* dout, float* dq, float* dk,
                   float* dv) {
  const int64_t B = s.B, T = s.T, Hq = s.Hq, D = s.D;
  // Di = rowsum(dO * O) of every (b, h, t), [B][Hq][T].
  std::vector<float> di(B * Hq * T);
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t h = 0; h < Hq; ++h)
      di[(b * Hq + h) * T + t] = dot(out + (bt * Hq + h) * D, dout + (bt * Hq + h) * D, D);
  }
  const Backward<ND> bw(s, q, k, v, lse, dout, di.data(), dq, dk, dv);
  const int64_t groups = B * s.Hkv;
  const int64_t threads = omp_get_max_threads();
  // Fraction of the threads that the fused scheme keeps busy with equal-sized units.
  const double busy = double(groups) / double(threads * ((groups + threads - 1) / threads));
  if (busy >= 0.7) {
#pragma omp parallel
    {
      typename Backward<ND>::Buffers w(D);
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < groups; ++u) {
        const int64_t b = u / bw.Hkv, g = u % bw.Hkv;
        bw.zero_dq(b, g);
        for (int64_t k0 = 0; k0 < T; k0 += kBk) bw.key_tile(w, b, g, k0, /*with_dq=*/true);
      }
    }
    return;
  }
  const int64_t nkt = bw.key_tiles(), nqt = bw.query_tiles();
#pragma omp parallel
  {
    typename Backward<ND>::Buffers w(D);
    // Key tile 0 is seen by every query tile: the heaviest units go first.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t u = 0; u < groups * nkt; ++u) {
      const int64_t kj = u / groups, bg = u % groups;
      bw.key_tile(w, bg / bw.Hkv, bg % bw.Hkv, kj * kBk, /*with_dq=*/false);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < B * Hq * nqt; ++u) {
      const int64_t qi = nqt - 1 - u / (B * Hq), bh = u % (B * Hq);
      bw.query_tile(w, bh / Hq, bh % Hq, qi * kBq);
    }
  }
}

template <template <int> class F, class... Args>
void dispatch_head_dim(int64_t D, Args&&... args) {
  switch (D % kW == 0 ? D / kW : 0) {
    case 1:
      F<1>::run(args...);
      break;
    case 2:
      F<2>::run(args...);
      break;
    case 3:
      F<3>::run(args...);
      break;
    case 4:
      F<4>::run(args...);
      break;
    case 5:
      F<5>::run(args...);
      break;
    case 6:
      F<6>::run(args...);
      break;
    case 7:
      F<7>::run(args...);
      break;
    case 8:
      F<8>::run(args...);
      break;
    default:
      F<0>::run(args...);
      break;
  }
}
template <int ND>
struct ForwardOp {
  template <class... Args>
  static void run(Args... args) {
    forward_impl<ND>(args...);
  }
};
template <int ND>
struct BackwardOp {
  template <class... Args>
  static void run(Args... args) {
    backward_impl<ND>(args...);
  }
};

}  // namespace

void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* out, float* lse) {
  check_shape(s, "attention_forward");
  LOOM_CHECK(q && k && v && out && lse, "attention_forward: null pointer among q, k, v, out, lse");
  dispatch_head_dim<ForwardOp>(s.D, s, q, k, v, out, lse);
}

void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv) {
  check_shape(s, "attention_backward");
  LOOM_CHECK(q && k && v && out && lse && dout && dq && dk && dv,
             "attention_backward: null pointer among q, k, v, out, lse, dout, dq, dk, dv");
  dispatch_head_dim<BackwardOp>(s.D, s, q, k, v, out, lse, dout, dq, dk, dv);
}

}  // namespace loom::cpu
