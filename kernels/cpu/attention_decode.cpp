#include "kernels/cpu/attention_decode.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public function below dispatches to the tier in
// use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention_decode.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// Folds two vectors of partial sums into one: lanes of x and y in alternating blocks of B, the
// two halves of each 2B-block added.
template <int B, int... L>
constexpr vi fold_mask(bool hi, std::integer_sequence<int, L...>) {
  return vi{(((L / B) % 2) ? int(kW) : 0) + (L / (2 * B)) * 2 * B + L % B + (hi ? B : 0)...};
}
template <int B>
inline vf fold(vf x, vf y) {
  constexpr auto seq = std::make_integer_sequence<int, int(kW)>();
  constexpr vi lo = fold_mask<B>(false, seq), hi = fold_mask<B>(true, seq);
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}
// kW horizontal sums in log2(kW) rounds of shuffles and adds (instead of kW serial reductions):
// round B folds pairs of vectors in blocks of B lanes. a[bitrev(i)] ends in lane i.
template <int B>
inline void fold_rounds(vf* a, int n) {
  for (int i = 0; i < n / 2; ++i) a[i] = fold<B>(a[2 * i], a[2 * i + 1]);
  if constexpr (B > 1) fold_rounds<B / 2>(a, n / 2);
}
inline vf reduce_lanes(vf* a) {
  fold_rounds<int(kW) / 2>(a, int(kW));
  return a[0];
}
constexpr int bitrev(int i) {
  int r = 0;
  for (int b = 1; b < kW; b <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

// sr[j] = q . k_j for the nj keys at kb + j*stride, kW keys per vector of results; NC is D/kW
// when it is a small constant (the loops unroll), 0 for any D. sr must hold nj rounded up to kW.
template <int NC>
void scores(const float* qr, const float* kb, int64_t stride, int64_t nj, int64_t D, float* sr) {
  const int64_t nc = NC ? NC : D / kW;
  for (int64_t jb = 0; jb < nj; jb += kW) {
    const int64_t n = std::min(kW, nj - jb);
    vf acc[kW];
    for (int j = 0; j < kW; ++j) {
      vf a{};
      if (j < n) {
        const float* kj = kb + (jb + j) * stride;
        for (int64_t c = 0; c < nc; ++c) a += load(qr + c * kW) * load(kj + c * kW);
      }
      acc[bitrev(j)] = a;  // so key j's sum lands in lane j
    }
    store(sr + jb, reduce_lanes(acc));
    for (int64_t j = 0; j < n && nc * kW < D; ++j)
      for (int64_t d = nc * kW; d < D; ++d) sr[jb + j] += qr[d] * kb[(jb + j) * stride + d];
  }
}

// ar = ar * alpha + sum_j p[j] v_j over the nj values at vb + j*stride. With NC known the
// accumulators stay in registers across the keys.
template <int NC>
void accumulate_pv(const float* p, const float* vb, int64_t stride, int64_t nj, int64_t D,
                   float alpha, float* __restrict ar) {
  const int64_t nc = NC ? NC : D / kW;
  if constexpr (NC > 0) {
    vf a[NC];
    for (int c = 0; c < NC; ++c) a[c] = load(ar + c * kW) * alpha;
    for (int64_t j = 0; j < nj; ++j) {
      const vf pj = vf{} + p[j];
      const float* vj = vb + j * stride;
      for (int c = 0; c < NC; ++c) a[c] += pj * load(vj + c * kW);
    }
    for (int c = 0; c < NC; ++c) store(ar + c * kW, a[c]);
  } else {
    for (int64_t c = 0; c < nc; ++c) {
      vf a = load(ar + c * kW) * alpha;
      for (int64_t j = 0; j < nj; ++j) a += p[j] * load(vb + j * stride + c * kW);
      store(ar + c * kW, a);
    }
  }
  for (int64_t d = nc * kW; d < D; ++d) {
    float a = ar[d] * alpha;
    for (int64_t j = 0; j < nj; ++j) a += p[j] * vb[j * stride + d];
    ar[d] = a;
  }
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows (query, head) of one work unit: the heads of a kv group for one or more queries share
// every key and value row the unit loads. Keys go by tiles of kBk with an online softmax, so the
// scratch does not grow with L.
constexpr int64_t kRows = 16, kBk = 64;
static_assert(kBk % kW == 0);

struct Scratch {
  std::vector<float> qs, acc, sc;
  explicit Scratch(int64_t D)
      : qs(size_t(kRows * D)), acc(size_t(kRows * D)), sc(size_t(kRows * kBk)) {}
};

// Rows [r0, r1) of kv group g; row r is query r / G, head g*G + r % G.
template <int NC>
void decode_unit(const DecodeShape& s, const float* q, const float* k, const float* v, float* out,
                 int64_t g, int64_t r0, int64_t r1, Scratch& w) {
  const int64_t G = s.Hq / s.Hkv, D = s.D, past = s.L - s.Tq, R = r1 - r0;
  float* qs = w.qs.data();
  float* acc = w.acc.data();
  float* sc = w.sc.data();
  float m[kRows], l[kRows];
  int64_t lim[kRows] = {};  // keys [0, lim) are visible to the row
  // Scores in base 2: the scale and log2(e) are folded into the query once.
  const float mul = s.scale * kLog2e;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) / G, h = g * G + (r0 + r) % G;
    const float* qr = q + i * s.q_stride + h * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qr[d] * mul;
    std::fill_n(acc + r * D, D, 0.0f);
    m[r] = kNegInf;
    l[r] = 0;
    lim[r] = past + i + 1;
  }
  const float* kg = k + g * D;
  const float* vg = v + g * D;
  const int64_t kend = lim[R - 1];
  for (int64_t j0 = 0; j0 < kend; j0 += kBk) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nj = std::min(kBk, lim[r] - j0);
      if (nj <= 0) continue;
      float* __restrict sr = sc + r * kBk;
      const float* qr = qs + r * D;
      scores<NC>(qr, kg + j0 * s.kv_stride, s.kv_stride, nj, D, sr);
      float tmax = kNegInf;
      for (int64_t j = 0; j < nj; ++j) tmax = std::max(tmax, sr[j]);
      const int64_t npad = (nj + kW - 1) / kW * kW;
      for (int64_t j = nj; j < npad; ++j) sr[j] = kNegInf;
      // The first tile always holds key 0, which every row sees, so m is finite from then on.
      const float mnew = std::max(m[r], tmax);
      const float alpha = std::exp2(m[r] - mnew);
      vf psum{};
      const vf mv = vf{} + mnew;
      for (int64_t j = 0; j < npad; j += kW) {
        const vf p = vexp2(load(sr + j) - mv);
        store(sr + j, p);
        psum += p;
      }
      float sum = 0;
      for (int c = 0; c < kW; ++c) sum += psum[c];
      l[r] = l[r] * alpha + sum;
      m[r] = mnew;
      accumulate_pv<NC>(sr, vg + j0 * s.kv_stride, s.kv_stride, nj, D, alpha, acc + r * D);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) / G, h = g * G + (r0 + r) % G;
    float* o = out + i * s.Hq * D + h * D;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
  }
}

}  // namespace

void attention_decode_impl(const DecodeShape& s, const float* q, const float* k, const float* v,
                           float* out) {
  const int64_t rows = s.Tq * (s.Hq / s.Hkv);
  const int64_t blocks = (rows + kRows - 1) / kRows, units = s.Hkv * blocks;
  // A short cache is a few microseconds of work: less than waking the other threads.
#pragma omp parallel if (units > 1 && s.Tq * s.Hq * s.L * s.D >= (int64_t(1) << 16))
  {
    Scratch w(s.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t g = u % s.Hkv, r0 = (u / s.Hkv) * kRows;
      const int64_t r1 = std::min(rows, r0 + kRows);
      switch (s.D / kW) {
        case 1:
          decode_unit<1>(s, q, k, v, out, g, r0, r1, w);
          break;
        case 2:
          decode_unit<2>(s, q, k, v, out, g, r0, r1, w);
          break;
        case 3:
          decode_unit<3>(s, q, k, v, out, g, r0, r1, w);
          break;
        case 4:
          decode_unit<4>(s, q, k, v, out, g, r0, r1, w);
          break;
        case 6:
          decode_unit<6>(s, q, k, v, out, g, r0, r1, w);
          break;
        case 8:
          decode_unit<8>(s, q, k, v, out, g, r0, r1, w);
          break;
        default:
          decode_unit<0>(s, q, k, v, out, g, r0, r1, w);
      }
    }
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {

HWY_EXPORT(attention_decode_impl);

void attention_decode(const DecodeShape& s, const float* q, const float* k, const float* v,
                      float* out) {
  LOOM_CHECK(s.Tq >= 0 && s.L >= s.Tq, "attention_decode: need 0 <= Tq <= L, got Tq=", s.Tq,
             " L=", s.L);
  LOOM_CHECK(s.Hkv > 0 && s.Hq > 0 && s.Hq % s.Hkv == 0,
             "attention_decode: Hq must be a positive multiple of Hkv, got Hq=", s.Hq,
             " Hkv=", s.Hkv);
  LOOM_CHECK(s.D > 0, "attention_decode: head dim must be > 0, got ", s.D);
  LOOM_CHECK(s.q_stride >= s.Hq * s.D, "attention_decode: q_stride (", s.q_stride,
             ") must be >= Hq*D (", s.Hq * s.D, ")");
  LOOM_CHECK(s.kv_stride >= s.Hkv * s.D, "attention_decode: kv_stride (", s.kv_stride,
             ") must be >= Hkv*D (", s.Hkv * s.D, ")");
  if (s.Tq == 0) return;
  LOOM_CHECK(q && k && v && out, "attention_decode: null pointer");
  LOOM_DISPATCH(attention_decode_impl)(s, q, k, v, out);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
