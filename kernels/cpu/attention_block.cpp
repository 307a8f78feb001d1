#include "kernels/cpu/attention_block.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention_block.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/attention_tiles-inl.hpp"
#include "kernels/cpu/vec_math-inl.hpp"

// See vec_math-inl.hpp: the ABI note on vectors does not apply to functions internal to this file.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

using namespace tiles;
template <int ND>
void forward_impl(const BlockShape& s, const float* q, const float* k, const float* v,
                  const int64_t* q_pos, const int64_t* k_pos, float* out, float* lse,
                  const std::function<void()>* progress) {
  const int64_t Tq = s.Tq, Tk = s.Tk, Hq = s.Hq, D = s.D, G = s.Hq / s.Hkv;
  const int64_t qs = s.q_stride, kvs = s.kv_stride;
  // Padding: a padded query sees nothing, a padded key is seen by nobody.
  const Tiles qtiles(q_pos, Tq, kBq, std::numeric_limits<int64_t>::min());
  const Tiles ktiles(k_pos, Tk, kBk, std::numeric_limits<int64_t>::max());
  const int64_t nqt = qtiles.count, nkt = ktiles.count;
  const std::vector<int64_t> order = heaviest_first(qtiles, ktiles, true);
  const int64_t units = s.B * Hq * nqt;
  // Scores live in base-2 units: q is pre-scaled by scale*log2(e) so that exp becomes exp2.
  const float c = s.scale * kLog2e;
#pragma omp parallel
  {
    Scratch scratch(lines(D * kBq) + lines(kBk * kBq) + 3 * lines(kBq * D) + 3 * kBq);
    // (kp and vp are used when kPack.)
    float* qt = scratch.take(D * kBq);    // Q^T of the tile, [D][kBq]
    float* st = scratch.take(kBk * kBq);  // S^T then P^T of a tile pair, [kBk][kBq]
    float* o = scratch.take(kBq * D);     // unnormalized output rows, [kBq][D]
    float* kp = scratch.take(kBk * D);    // K and V rows of the key tile, packed: [kBk][D]
    float* vp = scratch.take(kBk * D);
    float* m = scratch.take(kBq);      // running max (base 2)
    float* l = scratch.take(kBq);      // running sum
    float* alpha = scratch.take(kBq);  // rescale factor of the current key tile
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t qi = order[u % nqt];
      const int64_t b = u / nqt / Hq, h = u / nqt % Hq, g = h / G;
      const int64_t q0 = qi * kBq, nq = std::min(kBq, Tq - q0);
      const int64_t nvq = (nq + kW - 1) / kW;
      const int64_t* qp = qtiles.padded.data() + q0;
      transpose_tile(q + (b * Tq + q0) * qs + h * D, qs, nq, nvq * kW, D, qt, kBq, c);
      std::fill(m, m + kBq, kNegInf);
      std::fill(l, l + kBq, 0.0f);
      std::fill(o, o + nq * D, 0.0f);
      bool first = true;
      for (int64_t kj = 0; kj < nkt; ++kj) {
        const int64_t k0 = kj * kBk, nk = std::min(kBk, Tk - k0);
        const PairMask mask(qtiles, qi, ktiles, kj, nq, nk);
        if (mask.kind == Pair::none) continue;
        const float* kb = k + (b * Tk + k0) * kvs + g * D;
        const float* vb = v + (b * Tk + k0) * kvs + g * D;
        int64_t ld = kvs;
        if constexpr (kPack) {  // see kPack
          pack_rows(kb, kvs, nk, D, kp);
          pack_rows(vb, kvs, nk, D, vp);
          kb = kp, vb = vp, ld = D;
        }
        // Rows are keys: row block [r0, r1) needs the query vectors from key r0's first query.
        scores(Score{kb, ld, qt, kBq, st, kBq, D}, nk, [&](int64_t r0, int64_t) {
          return std::pair<int64_t, int64_t>(mask.first_query(r0) / kW, nvq);
        });
        // Masked entries get -inf, so that exp2 gives them exactly 0.
        if (mask.diagonal) {
          for (int64_t j = 0; j < nk; ++j)
            std::fill_n(st + j * kBq, std::min(mask.first_query(j), nvq * kW), kNegInf);
        } else if (mask.by_position()) {
          const int64_t* kp = ktiles.padded.data() + k0;
          for (int64_t j = 0; j < nk; ++j) {
            const int64_t kpj = kp[j];
            float* row = st + j * kBq;
#pragma omp simd
            for (int64_t i = 0; i < nvq * kW; ++i) row[i] = kpj <= qp[i] ? row[i] : kNegInf;
          }
        }
        // Online softmax, vectorized over 16 queries at a time. A query that has seen no key
        // yet has a running max of -inf; subtracting 0 instead keeps exp2's argument at -inf
        // (giving 0) where -inf - -inf would give NaN.
        for (int64_t vq = 0; vq < nvq; ++vq) {
          float* col = st + vq * kW;
          vf mt = load(col);
          for (int64_t j = 1; j < nk; ++j) mt = vmax(mt, load(col + j * kBq));
          const vf mo = load(m + vq * kW);
          const vf mn = vmax(mo, mt);
          const vf ms = mn == splat(kNegInf) ? vf{} : mn;
          const vf al = vexp2(mo - ms);
          vf sum{};
          for (int64_t j = 0; j < nk; ++j) {
            const vf p = vexp2(load(col + j * kBq) - ms);
            store(col + j * kBq, p);
            sum += p;
          }
          store(l + vq * kW, load(l + vq * kW) * al + sum);
          store(m + vq * kW, mn);
          store(alpha + vq * kW, al);
        }
        // O = alpha * O + P V; before the first key tile O is zero and alpha is not needed.
        accumulate<ND>(Accum{st, 1, kBq, vb, ld, o, D, D, first ? nullptr : alpha}, nq,
                       [&](int64_t, int64_t r1) {
                         return std::pair<int64_t, int64_t>(0, mask.key_limit(r1 - 1));
                       });
        first = false;
      }
      finish_query_tile(o, D, m, l, nq, D, out + ((b * Tq + q0) * Hq + h) * D, Hq * D,
                        lse + (b * Hq + h) * Tq + q0);
      report_progress(progress);
    }
  }
}

// Backward of one block pair (flash backward): the scores of a (query tile, key tile) pair
// are recomputed from q, k and the final lse, then feed dV += P^T dO, dK += dS^T Q, dQ += dS K.
// Work is split so that every output element has a single writer and a summation order that
// does not depend on the number of threads:
//  - fused scheme, units (batch, kv group): a unit owns dk/dv of the group and dq of the group's
//    heads, and walks key tiles in order, adding each key tile's dq contribution in place;
//  - split scheme, when there are too few (batch, kv group) units to feed the threads: units
//    (batch, kv group, key tile) compute dk/dv, then units (batch, head, query tile) recompute P
//    and dS to add dq, walking key tiles in the same order.
// Both run the same kernels in the same order for each output element, so the results are
// bit-identical whichever scheme (and thread count) is used.
template <int ND>
class Backward : public BackwardBase {
 public:
  Backward(const BlockShape& s, const float* q, const float* k, const float* v,
           const int64_t* q_pos, const int64_t* k_pos, const float* lse, const float* di,
           const float* dout, float* dq, float* dk, float* dv)
      : BackwardBase(s, q_pos, k_pos, lse, di, dout, dq, dk, dv), q(q), k(k), v(v) {}

  struct Buffers {
    explicit Buffers(int64_t D)
        : mem(2 * lines(D * kBk) + 2 * lines(kBq * kBk) + 2 * lines(kBk * D) +
              (kPack ? 3 * lines(kBk * D) : 0)),
          kt(mem.take(D * kBk)),
          vt(mem.take(D * kBk)),
          p(mem.take(kBq * kBk)),
          ds(mem.take(kBq * kBk)),
          dkacc(mem.take(kBk * D)),
          dvacc(mem.take(kBk * D)),
          kp(kPack ? mem.take(kBk * D) : nullptr),
          qp(kPack ? mem.take(kBq * D) : nullptr),
          dop(kPack ? mem.take(kBq * D) : nullptr) {}
    Scratch mem;
    float* kt;     // K^T of the key tile, [D][kBk]
    float* vt;     // V^T
    float* p;      // S then P, [kBq][kBk]
    float* ds;     // dP then dS (times scale)
    float* dkacc;  // [kBk][D]
    float* dvacc;
    float *kp, *qp, *dop;  // packed rows of K, Q, dO (kPack), [kBk or kBq][D]
    // Rows of the current key tile of K, query tile of Q and dO: packed, or in place.
    const float *krows = nullptr, *qrows = nullptr, *dorows = nullptr;
    int64_t kld = 0, qld = 0, dold = 0;
  };

  // The tile walks' steps (backward_key_tile, backward_query_tile in attention_tiles-inl.hpp).

  // dk/dv of key tile kj accumulate in dkacc, dvacc: from zero (overwrite) or from dk, dv.
  void start_key_tile(Buffers& w, int64_t b, int64_t g, int64_t kj) const {
    const int64_t k0 = kj * kBk, nk = std::min(kBk, Tk - k0);
    if (overwrite) {
      std::fill_n(w.dkacc, nk * D, 0.0f);
      std::fill_n(w.dvacc, nk * D, 0.0f);
      return;
    }
    for (int64_t j = 0; j < nk; ++j) {
      std::copy_n(dk + (b * Tk + k0 + j) * kvs + g * D, D, w.dkacc + j * D);
      std::copy_n(dv + (b * Tk + k0 + j) * kvs + g * D, D, w.dvacc + j * D);
    }
  }
  void finish_key_tile(Buffers& w, int64_t b, int64_t g, int64_t kj) const {
    const int64_t k0 = kj * kBk, nk = std::min(kBk, Tk - k0);
    for (int64_t j = 0; j < nk; ++j) {
      std::copy_n(w.dkacc + j * D, D, dk + (b * Tk + k0 + j) * kvs + g * D);
      std::copy_n(w.dvacc + j * D, D, dv + (b * Tk + k0 + j) * kvs + g * D);
    }
  }
  // dV += P^T dO, dK += dS^T Q of one tile pair, into the accumulators.
  void add_dkdv(Buffers& w, int64_t, int64_t, const PairMask& mask) const {
    // Rows are keys: row block [r0, r1) is seen from key r0's first query on.
    const auto queries = [&](int64_t r0, int64_t) {
      return std::pair<int64_t, int64_t>(mask.first_query(r0), mask.nq);
    };
    accumulate<ND>(Accum{w.p, 1, kBk, w.dorows, w.dold, w.dvacc, D, D}, mask.nk, queries);
    accumulate<ND>(Accum{w.ds, 1, kBk, w.qrows, w.qld, w.dkacc, D, D}, mask.nk, queries);
  }
  // The split scheme adds into dq from zero (overwrite) or from dq.
  void start_query_tile(int64_t b, int64_t h, int64_t qi) const {
    const int64_t q0 = qi * kBq, nq = std::min(kBq, Tq - q0);
    if (overwrite)
      for (int64_t i = 0; i < nq; ++i) std::fill_n(dq + (b * Tq + q0 + i) * qs + h * D, D, 0.0f);
  }

  // Zeroes the dq rows of (b, g)'s heads before the fused scheme adds into them (overwrite).
  void zero_dq(int64_t b, int64_t g) const {
    for (int64_t t = 0; t < Tq; ++t) std::fill_n(dq + (b * Tq + t) * qs + g * G * D, G * D, 0.0f);
  }

  void load_kv_tile(Buffers& w, int64_t b, int64_t g, int64_t k0, int64_t nk) const {
    transpose_tile(k + (b * Tk + k0) * kvs + g * D, kvs, nk, kBk, D, w.kt, kBk, 1.0f);
    transpose_tile(v + (b * Tk + k0) * kvs + g * D, kvs, nk, kBk, D, w.vt, kBk, 1.0f);
    w.krows = k + (b * Tk + k0) * kvs + g * D, w.kld = kvs;
    if constexpr (kPack) {  // see kPack
      pack_rows(w.krows, kvs, nk, D, w.kp);
      w.krows = w.kp, w.kld = D;
    }
  }
  void load_q_tile(Buffers& w, int64_t b, int64_t h, int64_t qi) const {
    const int64_t q0 = qi * kBq, nq = std::min(kBq, Tq - q0);
    w.qrows = q + (b * Tq + q0) * qs + h * D, w.qld = qs;
    w.dorows = dout + (b * Tq + q0) * os + h * D, w.dold = os;
    if constexpr (kPack) {
      pack_rows(w.qrows, qs, nq, D, w.qp);
      pack_rows(w.dorows, os, nq, D, w.dop);
      w.qrows = w.qp, w.qld = D, w.dorows = w.dop, w.dold = D;
    }
  }

  // P (exact zeros where masked, and on rows that see no key at all: lse = -inf) into w.p and
  // dS * scale into w.ds, [kBq][kBk], zero past the tile's keys.
  void probs_and_grads(Buffers& w, int64_t b, int64_t h, int64_t q0, int64_t k0,
                       const PairMask& mask) const {
    const int64_t nq = mask.nq, nk = mask.nk;
    const int64_t nvk = (nk + kW - 1) / kW;
    // Rows are queries: row block [r0, r1) needs the key vectors up to query r1 - 1's limit.
    const auto key_vectors = [&](int64_t, int64_t r1) {
      return std::pair<int64_t, int64_t>(0, (mask.key_limit(r1 - 1) + kW - 1) / kW);
    };
    scores(Score{w.qrows, w.qld, w.kt, kBk, w.p, kBk, D}, nq, key_vectors);
    scores(Score{w.dorows, w.dold, w.vt, kBk, w.ds, kBk, D}, nq, key_vectors);
    vi iota;
    for (int l = 0; l < kW; ++l) iota[l] = l;
    const float* lrow = lse + (b * Hq + h) * Tq + q0;
    const float* drow = di + (b * Hq + h) * Tq + q0;
    for (int64_t i = 0; i < nq; ++i) {
      float* prow = w.p + i * kBk;
      float* dsrow = w.ds + i * kBk;
      const int64_t lim = lrow[i] == kNegInf ? 0 : mask.key_limit(i);
      const int64_t nv = (lim + kW - 1) / kW;
      const float l2 = lrow[i] * kLog2e, dval = drow[i];
      for (int64_t vk = 0; vk < nv; ++vk) {
        const vi visible = iota + int32_t(vk * kW) < int32_t(lim);
        vf pv = vexp2(load(prow + vk * kW) * c - l2);
        pv = visible ? pv : vf{};
        store(prow + vk * kW, pv);
        store(dsrow + vk * kW, pv * (load(dsrow + vk * kW) - dval) * scale);
      }
      for (int64_t vk = nv; vk < kBk / kW; ++vk) {
        store(prow + vk * kW, vf{});
        store(dsrow + vk * kW, vf{});
      }
    }
    if (!mask.by_position()) return;
    // Selects, not products: an invisible entry's P may be huge (its score is not bounded by
    // the row's lse), and its dS even inf.
    const int64_t* qp = qtiles.padded.data() + q0;
    const int64_t* kp = ktiles.padded.data() + k0;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t qpi = qp[i];
      float* prow = w.p + i * kBk;
      float* dsrow = w.ds + i * kBk;
#pragma omp simd
      for (int64_t j = 0; j < nvk * kW; ++j) {
        const bool vis = kp[j] <= qpi;
        prow[j] = vis ? prow[j] : 0.0f;
        dsrow[j] = vis ? dsrow[j] : 0.0f;
      }
    }
  }

  // dq[q0 + i] += sum_j dS[i][j] k[k0 + j], over the keys query i may see.
  void add_dq(Buffers& w, int64_t b, int64_t h, int64_t qi, int64_t, const PairMask& mask) const {
    const int64_t q0 = qi * kBq;
    accumulate<ND>(Accum{w.ds, kBk, 1, w.krows, w.kld, dq + (b * Tq + q0) * qs + h * D, qs, D},
                   mask.nq, [&](int64_t, int64_t r1) {
                     return std::pair<int64_t, int64_t>(0, mask.key_limit(r1 - 1));
                   });
  }

 private:
  const float *q, *k, *v;
};

template <int ND>
void backward_impl(const BlockShape& s, const float* q, const float* k, const float* v,
                   const int64_t* q_pos, const int64_t* k_pos, const float* lse, const float* delta,
                   const float* dout, float* dq, float* dk, float* dv,
                   const std::function<void()>* progress) {
  const Backward<ND> bw(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv);
  run_backward(bw, s, s.D, progress);
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

void attention_block_forward_impl(const BlockShape& s, const float* q, const float* k,
                                  const float* v, const int64_t* q_pos, const int64_t* k_pos,
                                  float* out, float* lse, const std::function<void()>* progress) {
  dispatch_head_dim<ForwardOp>(s.D, s, q, k, v, q_pos, k_pos, out, lse, progress);
}

void attention_block_backward_impl(const BlockShape& s, const float* q, const float* k,
                                   const float* v, const int64_t* q_pos, const int64_t* k_pos,
                                   const float* lse, const float* delta, const float* dout,
                                   float* dq, float* dk, float* dv,
                                   const std::function<void()>* progress) {
  dispatch_head_dim<BackwardOp>(s.D, s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv,
                                progress);
}

void attention_merge_impl(int64_t B, int64_t Tq, int64_t Hq, int64_t D, float* out_a, float* lse_a,
                          const float* out_b, const float* lse_b) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t li = (b * Hq + h) * Tq + t;
        const float la = lse_a[li], lb = lse_b[li];
        if (lb == kNegInf) continue;
        float* oa = out_a + (b * Tq + t) * Hq * D + h * D;
        const float* ob = out_b + (b * Tq + t) * Hq * D + h * D;
        if (la == kNegInf) {
          std::copy(ob, ob + D, oa);
          lse_a[li] = lb;
          continue;
        }
        const float m = std::max(la, lb);
        const float l = m + std::log(std::exp(la - m) + std::exp(lb - m));
        const float wa = std::exp(la - l), wb = std::exp(lb - l);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oa[d] = wa * oa[d] + wb * ob[d];
        lse_a[li] = l;
      }
}

void attention_delta_impl(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const float* out,
                          const float* dout, float* delta) {
  // Token-major, as out and dout are laid out.
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * Tq; ++bt) {
    const int64_t b = bt / Tq, t = bt % Tq;
    for (int64_t h = 0; h < Hq; ++h)
      delta[(b * Hq + h) * Tq + t] = dot(out + (bt * Hq + h) * D, dout + (bt * Hq + h) * D, D);
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check(const BlockShape& s, const char* who) {
  LOOM_CHECK(s.B > 0 && s.Tq > 0 && s.Tk > 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0, who,
             ": B, Tq, Tk, Hq, Hkv, D must be positive, got B=", s.B, " Tq=", s.Tq, " Tk=", s.Tk,
             " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
  LOOM_CHECK(s.Hq % s.Hkv == 0, who, ": Hq (", s.Hq, ") must be a multiple of Hkv (", s.Hkv, ")");
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, who, ": q_stride ", s.q_stride, " < Hq*D = ", s.Hq * s.D);
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, who, ": kv_stride ", s.kv_stride,
             " < Hkv*D = ", s.Hkv * s.D);
  LOOM_CHECK(std::isfinite(s.scale) && s.scale > 0, who, ": scale must be finite and > 0, got ",
             s.scale);
}

}  // namespace

HWY_EXPORT(attention_block_forward_impl);
HWY_EXPORT(attention_block_backward_impl);
HWY_EXPORT(attention_merge_impl);
HWY_EXPORT(attention_delta_impl);

int64_t causal_entries(const int64_t* q_pos, int64_t Tq, const int64_t* k_pos, int64_t Tk) {
  int64_t n = 0;
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t j = 0; j < Tk; ++j) n += k_pos[j] <= q_pos[i];
  return n;
}

int64_t tiled_entries(const int64_t* q_pos, int64_t Tq, const int64_t* k_pos, int64_t Tk) {
  struct Tile {
    int64_t lo, hi, n;
  };
  const auto tiles = [](const int64_t* pos, int64_t n) {
    std::vector<Tile> t;
    for (int64_t i = 0; i < n; i += kAttentionTile) {
      const int64_t m = std::min(kAttentionTile, n - i);
      const auto [lo, hi] = std::minmax_element(pos + i, pos + i + m);
      t.push_back({*lo, *hi, m});
    }
    return t;
  };
  // A pair is skipped only when every key follows every query: a query tile meets the key tiles
  // whose lowest position is at most its highest. Key tiles sorted by that, with running sums of
  // their sizes, count them by a binary search (the planner calls this for every block of a
  // million-token sequence; the pairwise loop was 90% of such a plan).
  std::vector<Tile> keys = tiles(k_pos, Tk);
  std::sort(keys.begin(), keys.end(), [](const Tile& a, const Tile& b) { return a.lo < b.lo; });
  std::vector<int64_t> below(keys.size() + 1, 0);  // keys in the first i sorted tiles
  for (size_t i = 0; i < keys.size(); ++i) below[i + 1] = below[i] + keys[i].n;
  int64_t n = 0;
  for (const Tile& qt : tiles(q_pos, Tq)) {
    const auto met = std::upper_bound(keys.begin(), keys.end(), qt.hi,
                                      [](int64_t hi, const Tile& kt) { return hi < kt.lo; });
    n += qt.n * below[size_t(met - keys.begin())];
  }
  return n;
}

void attention_block_forward(const BlockShape& s, const float* q, const float* k, const float* v,
                             const int64_t* q_pos, const int64_t* k_pos, float* out, float* lse,
                             const std::function<void()>& progress) {
  check(s, "attention_block_forward");
  LOOM_CHECK(q && k && v && q_pos && k_pos && out && lse,
             "attention_block_forward: null pointer among q, k, v, q_pos, k_pos, out, lse");
  // Thread 0 may finish no unit at all when the other threads take them all (a small block, or
  // thread 0 descheduled): one call up front starts the transfer in any case.
  if (progress) progress();
  LOOM_DISPATCH(attention_block_forward_impl)(s, q, k, v, q_pos, k_pos, out, lse, &progress);
}

void attention_merge(int64_t B, int64_t Tq, int64_t Hq, int64_t D, float* out_a, float* lse_a,
                     const float* out_b, const float* lse_b) {
  LOOM_DISPATCH(attention_merge_impl)(B, Tq, Hq, D, out_a, lse_a, out_b, lse_b);
}

void attention_delta(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const float* out,
                     const float* dout, float* delta) {
  LOOM_DISPATCH(attention_delta_impl)(B, Tq, Hq, D, out, dout, delta);
}

void attention_block_backward(const BlockShape& s, const float* q, const float* k, const float* v,
                              const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                              const float* delta, const float* dout, float* dq, float* dk,
                              float* dv, const std::function<void()>& progress) {
  check(s, "attention_block_backward");
  LOOM_CHECK(q && k && v && q_pos && k_pos && lse && delta && dout && dq && dk && dv,
             "attention_block_backward: null pointer among q, k, v, q_pos, k_pos, lse, delta, "
             "dout, dq, dk, dv");
  if (progress) progress();  // as in attention_block_forward
  LOOM_DISPATCH(attention_block_backward_impl)
  (s, q, k, v, q_pos, k_pos, lse, delta, dout, dq, dk, dv, &progress);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
