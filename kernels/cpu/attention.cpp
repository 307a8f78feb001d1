#include "kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "core/error.hpp"
#include "kernels/cpu/attention_tiles.hpp"
#include "kernels/cpu/vec_math.hpp"

// The 64-byte vector type v16 (vec_math.hpp) is handled as two or four registers when AVX-512 is
// off (LOOM_NATIVE=OFF); GCC then warns that the ABI of functions passing it differs, which does
// not matter for functions internal to this file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loom::cpu {
namespace {

using namespace tiles;

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
