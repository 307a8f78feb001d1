#include "kernels/cpu/attention_decode.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"

// The 64-byte vector type is split into narrower registers without AVX-512; GCC then warns that
// the ABI of functions passing it differs, which does not matter for functions local to this file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loom::cpu {
namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int64_t kW = 16;

inline v16 load(const float* p) {
  return *reinterpret_cast<const v16u*>(p);
}
inline void store(float* p, v16 x) {
  *reinterpret_cast<v16u*>(p) = x;
}

// ln(2)^k / k!, the Taylor coefficients of 2^f.
constexpr float exp2_coef(int k) {
  double c = 1;
  for (int i = 1; i <= k; ++i) c *= 0.6931471805599453 / i;
  return float(c);
}

// 2^x: x = n + f with n = round(x), |f| <= 1/2, and 2^f by its Taylor polynomial of degree 7
// (truncation below 6e-9, under float rounding). x <= -127 (masked scores: -inf) gives exactly 0.
inline v16 exp2v(v16 x) {
  const v16 lo = v16{} - 127.0f, hi = v16{} + 127.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16 magic = v16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v16 t = x + magic;
  const v16 n = t - magic;
  const v16 f = x - n;
  const v16i ni = __builtin_bit_cast(v16i, t) - __builtin_bit_cast(v16i, magic);
  v16 p = v16{} + exp2_coef(7);
  p = p * f + exp2_coef(6);
  p = p * f + exp2_coef(5);
  p = p * f + exp2_coef(4);
  p = p * f + exp2_coef(3);
  p = p * f + exp2_coef(2);
  p = p * f + exp2_coef(1);
  p = p * f + 1.0f;
  return p * __builtin_bit_cast(v16, (ni + 127) << 23);
}

// A plain loop would add the products one after the other (no reassociation without
// -ffast-math); sixteen partial sums let it run at vector speed.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  v16 acc{};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc += load(a + i) * load(b + i);
  float sum = 0;
  for (int l = 0; l < kW; ++l) sum += acc[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

constexpr float kLog2e = 1.4426950408889634f;
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
void decode_unit(const DecodeShape& s, const float* q, const float* k, const float* v, float* out,
                 int64_t g, int64_t r0, int64_t r1, Scratch& w) {
  const int64_t G = s.Hq / s.Hkv, D = s.D, past = s.L - s.Tq, R = r1 - r0;
  float* qs = w.qs.data();
  float* acc = w.acc.data();
  float* sc = w.sc.data();
  float m[kRows], l[kRows];
  int64_t lim[kRows];  // keys [0, lim) are visible to the row
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
      float tmax = kNegInf;
      for (int64_t j = 0; j < nj; ++j) {
        sr[j] = dot(qr, kg + (j0 + j) * s.kv_stride, D);
        tmax = std::max(tmax, sr[j]);
      }
      const int64_t npad = (nj + kW - 1) / kW * kW;
      for (int64_t j = nj; j < npad; ++j) sr[j] = kNegInf;
      // The first tile always holds key 0, which every row sees, so m is finite from then on.
      const float mnew = std::max(m[r], tmax);
      const float alpha = std::exp2(m[r] - mnew);
      v16 psum{};
      const v16 mv = v16{} + mnew;
      for (int64_t j = 0; j < npad; j += kW) {
        const v16 p = exp2v(load(sr + j) - mv);
        store(sr + j, p);
        psum += p;
      }
      float sum = 0;
      for (int c = 0; c < kW; ++c) sum += psum[c];
      l[r] = l[r] * alpha + sum;
      m[r] = mnew;
      float* __restrict ar = acc + r * D;
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      for (int64_t j = 0; j < nj; ++j) {
        const float p = sr[j];
        const float* __restrict vj = vg + (j0 + j) * s.kv_stride;
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vj[d];
      }
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
  const int64_t rows = s.Tq * (s.Hq / s.Hkv);
  const int64_t blocks = (rows + kRows - 1) / kRows, units = s.Hkv * blocks;
#pragma omp parallel if (units > 1)
  {
    Scratch w(s.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t g = u % s.Hkv, r0 = (u / s.Hkv) * kRows;
      decode_unit(s, q, k, v, out, g, r0, std::min(rows, r0 + kRows), w);
    }
  }
}

}  // namespace loom::cpu
