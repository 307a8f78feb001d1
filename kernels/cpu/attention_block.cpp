#include "kernels/cpu/attention_block.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"

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
}

inline float dotf(const float* a, const float* b, int64_t n) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Keys visible to a query at position p: the k_pos entries <= p. Positions inside a chunk are
// increasing but a block may hold two chunks, so the test is per key.
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

std::vector<int64_t> cp_positions(int64_t T, int64_t cp, int64_t rank, int64_t sp_tp) {
  LOOM_CHECK(cp >= 1 && rank >= 0 && rank < cp && sp_tp >= 1,
             "cp_positions: need cp >= 1, 0 <= rank < cp, tp >= 1; got cp=", cp, " rank=", rank,
             " tp=", sp_tp);
  const int64_t div = 2 * cp * sp_tp;
  LOOM_CHECK(T > 0 && T % div == 0, "context parallel: sequence length ", T,
             " must be divisible by 2*cp", sp_tp > 1 ? "*tp (sequence parallel)" : "", " = ", div,
             " (cp=", cp, sp_tp > 1 ? ", tp=" : "",
             sp_tp > 1 ? std::to_string(sp_tp) : std::string(), ")");
  const int64_t c = T / (2 * cp);
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(2 * c));
  for (int64_t chunk : {rank, 2 * cp - 1 - rank})
    for (int64_t t = 0; t < c; ++t) pos.push_back(chunk * c + t);
  return pos;
}

int64_t causal_entries(const int64_t* q_pos, int64_t Tq, const int64_t* k_pos, int64_t Tk) {
  int64_t n = 0;
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t j = 0; j < Tk; ++j) n += k_pos[j] <= q_pos[i];
  return n;
}

void attention_block_forward(const BlockShape& s, const float* q, const float* k, const float* v,
                             const int64_t* q_pos, const int64_t* k_pos, float* out, float* lse) {
  check(s, "attention_block_forward");
  const int64_t group = s.Hq / s.Hkv, D = s.D;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(s.Tk));
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t i = 0; i < s.Tq; ++i) {
          const float* qi = q + (b * s.Tq + i) * s.q_stride + h * D;
          const float* kb = k + b * s.Tk * s.kv_stride + (h / group) * D;
          const float* vb = v + b * s.Tk * s.kv_stride + (h / group) * D;
          float* o = out + (b * s.Tq + i) * s.Hq * D + h * D;
          float m = kNegInf;
          for (int64_t j = 0; j < s.Tk; ++j) {
            p[j] = k_pos[j] <= q_pos[i] ? dotf(qi, kb + j * s.kv_stride, D) * s.scale : kNegInf;
            m = std::max(m, p[j]);
          }
          std::fill(o, o + D, 0.0f);
          float& l = lse[(b * s.Hq + h) * s.Tq + i];
          if (m == kNegInf) {
            l = kNegInf;
            continue;
          }
          float sum = 0;
          for (int64_t j = 0; j < s.Tk; ++j) {
            if (p[j] == kNegInf) continue;
            const float e = std::exp(p[j] - m);
            sum += e;
            const float* vj = vb + j * s.kv_stride;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += e * vj[d];
          }
          const float inv = 1.0f / sum;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
          l = m + std::log(sum);
        }
  }
}

void attention_merge(int64_t B, int64_t Tq, int64_t Hq, int64_t D, float* out_a, float* lse_a,
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

void attention_delta(int64_t B, int64_t Tq, int64_t Hq, int64_t D, const float* out,
                     const float* dout, float* delta) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t o = (b * Tq + t) * Hq * D + h * D;
        delta[(b * Hq + h) * Tq + t] = dotf(out + o, dout + o, D);
      }
}

void attention_block_backward(const BlockShape& s, const float* q, const float* k, const float* v,
                              const int64_t* q_pos, const int64_t* k_pos, const float* lse,
                              const float* delta, const float* dout, float* dq, float* dk,
                              float* dv) {
  check(s, "attention_block_backward");
  const int64_t group = s.Hq / s.Hkv, D = s.D;
  // One task per (sample, kv head): dk/dv rows of that kv head are written by it alone, and so
  // are the dq rows of the query heads of its group, so no two threads touch the same output.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t g = 0; g < s.Hkv; ++g) {
      const float* kb = k + b * s.Tk * s.kv_stride + g * D;
      const float* vb = v + b * s.Tk * s.kv_stride + g * D;
      float* dkb = dk + b * s.Tk * s.kv_stride + g * D;
      float* dvb = dv + b * s.Tk * s.kv_stride + g * D;
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t i = 0; i < s.Tq; ++i) {
          const int64_t li = (b * s.Hq + h) * s.Tq + i;
          const float l = lse[li], di = delta[li];
          if (l == kNegInf) continue;
          const float* qi = q + (b * s.Tq + i) * s.q_stride + h * D;
          float* dqi = dq + (b * s.Tq + i) * s.q_stride + h * D;
          const float* doi = dout + (b * s.Tq + i) * s.Hq * D + h * D;
          for (int64_t j = 0; j < s.Tk; ++j) {
            if (k_pos[j] > q_pos[i]) continue;
            const float* kj = kb + j * s.kv_stride;
            const float* vj = vb + j * s.kv_stride;
            const float p = std::exp(dotf(qi, kj, D) * s.scale - l);
            const float ds = p * (dotf(doi, vj, D) - di) * s.scale;
            float* dkj = dkb + j * s.kv_stride;
            float* dvj = dvb + j * s.kv_stride;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) {
              dqi[d] += ds * kj[d];
              dkj[d] += ds * qi[d];
              dvj[d] += p * doi[d];
            }
          }
        }
    }
}

}  // namespace loom::cpu
