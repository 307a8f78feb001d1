#include "kernels/cpu/gla.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gla.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/cpu/vec_math-inl.hpp"

// Vectors passed by value: see vec_math-inl.hpp.
#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {
namespace {

// A decay factor e^x (x <= 0), exactly 0 below -87: vexp would return e^-87 there, and products
// of such factors would be denormals, which are slow and meaningless next to the other terms.
inline vf dexp(vf x) {
  const vf e = vexp(x);
  return x < splat(-87.0f) ? splat(0.0f) : e;
}
inline float dexp(float x) {
  return x < -87.0f ? 0.0f : vexp(x);
}

// The chunk-local cumsum b is kept in double: under strong decay |b| reaches 1e4 within a chunk,
// where an f32 ulp (1e-3) would be the error of every decay e^(b_r - b_j) between two nearby
// tokens. The differences are exact enough in double and then small or irrelevant (< -87) in f32.
typedef double vd __attribute__((vector_size(kW * 8)));
typedef double vdu __attribute__((vector_size(kW * 8), aligned(8), may_alias));  // unaligned
inline vf load_diff(const double* a, const double* b) {
  return __builtin_convertvector(
      *reinterpret_cast<const vdu*>(a) - *reinterpret_cast<const vdu*>(b), vf);
}

// out = x * e^(a - b), or e^(a - b) when x is null; n floats.
inline void mul_exp_diff(const float* x, const double* a, const double* b, float* out, int64_t n) {
  int64_t i = 0;
  if (x) {
    for (; i + kW <= n; i += kW) store(out + i, load(x + i) * dexp(load_diff(a + i, b + i)));
    for (; i < n; ++i) out[i] = x[i] * dexp(float(a[i] - b[i]));
  } else {
    for (; i + kW <= n; i += kW) store(out + i, dexp(load_diff(a + i, b + i)));
    for (; i < n; ++i) out[i] = dexp(float(a[i] - b[i]));
  }
}
// out = x * e^a.
inline void mul_exp(const float* x, const double* a, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    store(out + i,
          load(x + i) * dexp(__builtin_convertvector(*reinterpret_cast<const vdu*>(a + i), vf)));
  for (; i < n; ++i) out[i] = x[i] * dexp(float(a[i]));
}

inline float dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}
// y += a x
inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One chunk of one (sample, query head): row r of a tensor at base + r*ld.
struct ChunkView {
  const float *q, *k, *v, *g;
  int64_t ldq, ldk, ldv, ldg;
  int64_t n;  // rows in this chunk (the last may be short)
  const float* qr(int64_t r) const { return q + r * ldq; }
  const float* kr(int64_t r) const { return k + r * ldk; }
  const float* vr(int64_t r) const { return v + r * ldv; }
  const float* gr(int64_t r) const { return g + r * ldg; }
};

int64_t ld_or(const GlaIn& x, int64_t width) {
  return x.ld ? x.ld : width;
}

ChunkView chunk_view(const GlaCore& a, int64_t b, int64_t h, int64_t t0, int64_t n) {
  const int64_t hk = h / (a.H / a.Hkv);
  const int64_t row = b * a.T + t0;
  ChunkView c;
  c.ldq = ld_or(a.q, a.H * a.K);
  c.ldk = ld_or(a.k, a.Hkv * a.K);
  c.ldv = ld_or(a.v, a.Hkv * a.V);
  c.ldg = ld_or(a.gk, a.Hkv * a.K);
  c.q = a.q.p + row * c.ldq + h * a.K;
  c.k = a.k.p + row * c.ldk + hk * a.K;
  c.v = a.v.p + row * c.ldv + hk * a.V;
  c.g = a.gk.p + row * c.ldg + hk * a.K;
  c.n = n;
  return c;
}

// Per-thread buffers for one (sample, head) of a chunk of at most C rows.
struct Work {
  std::vector<double> bc;         // [C, K] chunk-local inclusive cumsum of gk
  std::vector<float> A;           // [C, C] scale * decayed q.k, lower triangle
  std::vector<float> E;           // [c, K] e^(b_r - rho) of the rows of a sub-chunk
  std::vector<float> Qp;          // [c, K] q_r e^(b_r - rho)
  std::vector<float> acc;         // [c, K] per-row accumulator of a sub-chunk
  std::vector<float> t0, t1, t2;  // [max(K, V)]
  Work(int64_t C, int64_t c, int64_t K, int64_t V)
      : bc(size_t(C * K)),
        A(size_t(C * C)),
        E(size_t(c * K)),
        Qp(size_t(c * K)),
        acc(size_t(c * K)),
        t0(size_t(std::max(K, V))),
        t1(size_t(std::max(K, V))),
        t2(size_t(std::max(K, V))) {}
};

void cumsum(const ChunkView& c, int64_t K, double* bc) {
  std::copy_n(c.gr(0), K, bc);
  for (int64_t r = 1; r < c.n; ++r) {
    const double* __restrict prev = bc + (r - 1) * K;
    const float* __restrict g = c.gr(r);
    double* __restrict cur = bc + r * K;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) cur[d] = prev[d] + g[d];
  }
}

// A[r, j] = scale * sum_d q_r[d] k_j[d] e^(b_r[d] - b_j[d]) for j <= r. Pairs of sub-chunks
// I > J factor the decay through rho = b at I's first row: q_r e^(b_r - rho) and k_j e^(rho - b_j),
// both factors <= 1 because b does not increase. Diagonal sub-chunks are element-wise.
void intra_scores(const ChunkView& c, int64_t K, int64_t sc, float scale, Work& w) {
  const double* bc = w.bc.data();
  float* A = w.A.data();
  const int64_t n = c.n;
  float* kp = w.t0.data();
  for (int64_t i0 = 0; i0 < n; i0 += sc) {
    const int64_t i1 = std::min(n, i0 + sc);
    const double* rho = bc + i0 * K;
    for (int64_t r = i0; r < i1; ++r)
      mul_exp_diff(c.qr(r), bc + r * K, rho, w.Qp.data() + (r - i0) * K, K);
    for (int64_t j = 0; j < i0; ++j) {
      mul_exp_diff(c.kr(j), rho, bc + j * K, kp, K);
      for (int64_t r = i0; r < i1; ++r)
        A[r * n + j] = scale * dot(w.Qp.data() + (r - i0) * K, kp, K);
    }
    for (int64_t r = i0; r < i1; ++r)
      for (int64_t j = i0; j <= r; ++j) {
        mul_exp_diff(c.kr(j), bc + r * K, bc + j * K, kp, K);
        A[r * n + j] = scale * dot(c.qr(r), kp, K);
      }
  }
}

// S <- Diag(e^b_last) S + sum_j (k_j e^(b_last - b_j)) v_j^T
void state_step(const ChunkView& c, int64_t K, int64_t V, const double* bc, float* S, float* kd) {
  const double* blast = bc + (c.n - 1) * K;
  for (int64_t d = 0; d < K; ++d) {
    const float e = dexp(float(blast[d]));
    float* __restrict Sd = S + d * V;
#pragma omp simd
    for (int64_t x = 0; x < V; ++x) Sd[x] *= e;
  }
  for (int64_t j = 0; j < c.n; ++j) {
    mul_exp_diff(c.kr(j), blast, bc + j * K, kd, K);
    const float* vj = c.vr(j);
    for (int64_t d = 0; d < K; ++d) axpy(kd[d], vj, S + d * V, V);
  }
}

void forward_head(const GlaCore& a, int64_t b, int64_t h, GlaOut o, float* ht, Work& w) {
  const int64_t K = a.K, V = a.V, C = a.chunk;
  const int64_t ldo = o.ld ? o.ld : a.H * V;
  std::vector<float> S(size_t(K * V), 0.0f);
  const size_t head = size_t((b * a.H + h) * K * V);
  if (a.h0) std::copy_n(a.h0 + head, K * V, S.data());
  float* qe = w.t1.data();
  for (int64_t t0 = 0; t0 < a.T; t0 += C) {
    const ChunkView c = chunk_view(a, b, h, t0, std::min(C, a.T - t0));
    cumsum(c, K, w.bc.data());
    intra_scores(c, K, a.sub_chunk, a.scale, w);
    for (int64_t r = 0; r < c.n; ++r) {
      float* __restrict orow = o.p + (b * a.T + t0 + r) * ldo + h * V;
      std::fill_n(orow, V, 0.0f);
      mul_exp(c.qr(r), w.bc.data() + r * K, qe, K);
      for (int64_t d = 0; d < K; ++d) axpy(a.scale * qe[d], S.data() + d * V, orow, V);
      for (int64_t j = 0; j <= r; ++j) axpy(w.A[r * c.n + j], c.vr(j), orow, V);
    }
    state_step(c, K, V, w.bc.data(), S.data(), w.t0.data());
  }
  if (ht) std::copy_n(S.data(), K * V, ht + head);
}

}  // namespace

void gla_forward_impl(const GlaCore& a, GlaOut o, float* ht) {
  const int64_t units = a.B * a.H;
#pragma omp parallel
  {
    Work w(a.chunk, a.sub_chunk, a.K, a.V);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) forward_head(a, u / a.H, u % a.H, o, ht, w);
  }
}

namespace {

// Accumulates query head h's gradients into the zeroed dk, dv, dgk rows of its kv head and writes
// its dq. Follows the chunked backward of docs/decisions/gla.md: the states S_[n] are recomputed by
// a forward sweep, then the chunks run in reverse with dS = dL/dS_[n+1].
void backward_head(const GlaCore& a, int64_t b, int64_t h, GlaIn dout, const float* dht,
                   const GlaCoreGrads& g, Work& w, std::vector<float>& states) {
  const int64_t K = a.K, V = a.V, C = a.chunk, sc = a.sub_chunk;
  const int64_t NT = (a.T + C - 1) / C;
  const float s = a.scale;
  const size_t KV = size_t(K * V);
  const size_t head = size_t((b * a.H + h) * K * V);
  const int64_t hk = h / (a.H / a.Hkv);
  const int64_t ldo = dout.ld ? dout.ld : a.H * V;
  const int64_t ldq = g.dq.ld ? g.dq.ld : a.H * K;
  const int64_t ldk = g.dk.ld ? g.dk.ld : a.Hkv * K;
  const int64_t ldv = g.dv.ld ? g.dv.ld : a.Hkv * V;
  const int64_t ldg = g.dgk.ld ? g.dgk.ld : a.Hkv * K;

  states.resize(size_t(NT + 1) * KV);
  if (a.h0)
    std::copy_n(a.h0 + head, KV, states.data());
  else
    std::fill_n(states.data(), KV, 0.0f);
  for (int64_t n = 0; n < NT; ++n) {
    const ChunkView c = chunk_view(a, b, h, n * C, std::min(C, a.T - n * C));
    std::copy_n(states.data() + n * KV, KV, states.data() + (n + 1) * KV);
    cumsum(c, K, w.bc.data());
    state_step(c, K, V, w.bc.data(), states.data() + (n + 1) * KV, w.t0.data());
  }

  std::vector<float> dS(KV, 0.0f), dA(size_t(C * C)), dkl(size_t(C * K)), gb(size_t(C * K));
  if (dht) std::copy_n(dht + head, KV, dS.data());
  float* t0 = w.t0.data();
  float* t1 = w.t1.data();
  for (int64_t n = NT - 1; n >= 0; --n) {
    const int64_t r0 = n * C;
    const ChunkView c = chunk_view(a, b, h, r0, std::min(C, a.T - r0));
    const int64_t m = c.n;
    const float* Sn = states.data() + n * KV;
    const float* Snext = states.data() + (n + 1) * KV;
    const double* bc = w.bc.data();
    cumsum(c, K, w.bc.data());
    intra_scores(c, K, sc, s, w);
    const double* blast = bc + (m - 1) * K;
    auto dor = [&](int64_t r) { return dout.p + (b * a.T + r0 + r) * ldo + h * V; };
    auto dqr = [&](int64_t r) { return g.dq.p + (b * a.T + r0 + r) * ldq + h * K; };
    auto dkr = [&](int64_t r) { return g.dk.p + (b * a.T + r0 + r) * ldk + hk * K; };
    auto dvr = [&](int64_t r) { return g.dv.p + (b * a.T + r0 + r) * ldv + hk * V; };
    auto dgr = [&](int64_t r) { return g.dgk.p + (b * a.T + r0 + r) * ldg + hk * K; };

    // dA[r, j] = dO_r . v_j (the gradient of A, which already holds the scale).
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j <= r; ++j) dA[r * m + j] = dot(dor(r), c.vr(j), V);

    // dv_j = sum_{r>=j} A[r,j] dO_r + dS^T (k_j e^(b_last - b_j)).
    for (int64_t j = 0; j < m; ++j) {
      float* dv = dvr(j);
      for (int64_t r = j; r < m; ++r) axpy(w.A[r * m + j], dor(r), dv, V);
      mul_exp_diff(c.kr(j), blast, bc + j * K, t0, K);
      for (int64_t d = 0; d < K; ++d) axpy(t0[d], dS.data() + d * V, dv, V);
    }

    // Inter-chunk parts: dq_r = s e^b_r (S_n dO_r), dk_j = e^(b_last - b_j) (dS v_j).
    for (int64_t r = 0; r < m; ++r) {
      float* dq = dqr(r);
      for (int64_t d = 0; d < K; ++d) t1[d] = s * dot(Sn + d * V, dor(r), V);
      mul_exp(t1, bc + r * K, dq, K);
      for (int64_t d = 0; d < K; ++d) t1[d] = dot(dS.data() + d * V, c.vr(r), V);
      mul_exp_diff(t1, blast, bc + r * K, dkl.data() + r * K, K);
    }

    // Intra-chunk parts, with the sub-chunk reference rows of intra_scores.
    for (int64_t i0 = 0; i0 < m; i0 += sc) {
      const int64_t i1 = std::min(m, i0 + sc);
      const double* rho = bc + i0 * K;
      for (int64_t r = i0; r < i1; ++r) {
        mul_exp_diff(nullptr, bc + r * K, rho, w.E.data() + (r - i0) * K, K);
        float* qp = w.Qp.data() + (r - i0) * K;
        const float* e = w.E.data() + (r - i0) * K;
        const float* q = c.qr(r);
#pragma omp simd
        for (int64_t d = 0; d < K; ++d) qp[d] = q[d] * e[d];
        std::fill_n(w.acc.data() + (r - i0) * K, K, 0.0f);
      }
      for (int64_t j = 0; j < i0; ++j) {
        mul_exp_diff(nullptr, rho, bc + j * K, t0, K);  // e^(rho - b_j)
        const float* kj = c.kr(j);
#pragma omp simd
        for (int64_t d = 0; d < K; ++d) t1[d] = kj[d] * t0[d];
        // dq_r (r in I) gathers dA[r,j] k_j e^(rho - b_j); dk_j gathers dA[r,j] q_r e^(b_r - rho).
        float* t2 = w.t2.data();
        std::fill_n(t2, K, 0.0f);
        for (int64_t r = i0; r < i1; ++r) {
          const float da = dA[r * m + j];
          axpy(da, t1, w.acc.data() + (r - i0) * K, K);
          axpy(da, w.Qp.data() + (r - i0) * K, t2, K);
        }
        float* dk = dkl.data() + j * K;
#pragma omp simd
        for (int64_t d = 0; d < K; ++d) dk[d] += s * t0[d] * t2[d];
      }
      for (int64_t r = i0; r < i1; ++r) {
        float* dq = dqr(r);
        const float* e = w.E.data() + (r - i0) * K;
        const float* ac = w.acc.data() + (r - i0) * K;
#pragma omp simd
        for (int64_t d = 0; d < K; ++d) dq[d] += s * e[d] * ac[d];
        for (int64_t j = i0; j <= r; ++j) {
          mul_exp_diff(nullptr, bc + r * K, bc + j * K, t0, K);  // e^(b_r - b_j)
          const float da = s * dA[r * m + j];
          const float* kj = c.kr(j);
          const float* q = c.qr(r);
          float* dk = dkl.data() + j * K;
#pragma omp simd
          for (int64_t d = 0; d < K; ++d) {
            dq[d] += da * kj[d] * t0[d];
            dk[d] += da * q[d] * t0[d];
          }
        }
      }
    }

    // dgk_t = sum_{r >= t in the chunk} (q_r dq_r - k_r dk_r) + rowsum(S_[n+1] dS), with this
    // head's full dq and dk.
    for (int64_t d = 0; d < K; ++d) t1[d] = dot(Snext + d * V, dS.data() + d * V, V);
    for (int64_t r = m - 1; r >= 0; --r) {
      const float* q = c.qr(r);
      const float* k = c.kr(r);
      const float* dq = dqr(r);
      const float* dkr_l = dkl.data() + r * K;
      float* dk = dkr(r);
      float* dg = dgr(r);
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) {
        t1[d] += q[d] * dq[d] - k[d] * dkr_l[d];
        dg[d] += t1[d];
        dk[d] += dkr_l[d];
      }
    }

    // dS_[n] = Diag(e^b_last) dS + s sum_r (q_r e^b_r) dO_r^T.
    for (int64_t d = 0; d < K; ++d) {
      const float e = dexp(float(blast[d]));
      float* __restrict x = dS.data() + d * V;
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) x[v] *= e;
    }
    for (int64_t r = 0; r < m; ++r) {
      mul_exp(c.qr(r), bc + r * K, t0, K);
      for (int64_t d = 0; d < K; ++d) axpy(s * t0[d], dor(r), dS.data() + d * V, V);
    }
  }
  if (g.dh0) std::copy_n(dS.data(), KV, g.dh0 + head);
}

}  // namespace

void gla_backward_impl(const GlaCore& a, GlaIn dout, const float* dht, const GlaCoreGrads& g) {
  const int64_t G = a.H / a.Hkv;
  const int64_t units = a.B * a.Hkv;
  const int64_t ldk = g.dk.ld ? g.dk.ld : a.Hkv * a.K;
  const int64_t ldv = g.dv.ld ? g.dv.ld : a.Hkv * a.V;
  const int64_t ldg = g.dgk.ld ? g.dgk.ld : a.Hkv * a.K;
#pragma omp parallel
  {
    Work w(a.chunk, a.sub_chunk, a.K, a.V);
    std::vector<float> states;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b = u / a.Hkv, hk = u % a.Hkv;
      for (int64_t t = 0; t < a.T; ++t) {
        const int64_t row = b * a.T + t;
        std::fill_n(g.dk.p + row * ldk + hk * a.K, a.K, 0.0f);
        std::fill_n(g.dv.p + row * ldv + hk * a.V, a.V, 0.0f);
        std::fill_n(g.dgk.p + row * ldg + hk * a.K, a.K, 0.0f);
      }
      for (int64_t i = 0; i < G; ++i) backward_head(a, b, hk * G + i, dout, dht, g, w, states);
    }
  }
}

void gla_decay_total_impl(int64_t B, int64_t T, int64_t Hkv, int64_t K, const float* gk,
                          float* decay) {
  const int64_t W = Hkv * K;
  for (int64_t b = 0; b < B; ++b) {
    float* __restrict out = decay + b * W;
    std::fill_n(out, W, 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      const float* __restrict g = gk + (b * T + t) * W;
#pragma omp simd
      for (int64_t i = 0; i < W; ++i) out[i] += g[i];
    }
  }
}

void gla_state_fold_impl(int64_t B, int64_t H, int64_t Hkv, int64_t K, int64_t V,
                         const float* decay, const float* E, float* S) {
  const int64_t G = H / Hkv;
#pragma omp parallel for collapse(2) schedule(static) if (B * H * K * V >= (int64_t{1} << 16))
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < K; ++i) {
        const float e = dexp(decay[(b * Hkv + h / G) * K + i]);
        float* __restrict row = S + ((b * H + h) * K + i) * V;
        const float* __restrict er = E + ((b * H + h) * K + i) * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) row[j] = e * row[j] + er[j];
      }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

void check_ld(const char* what, const char* name, int64_t ld, int64_t width) {
  LOOM_CHECK(ld == 0 || ld >= width, what, ": row stride of ", name, " is ", ld,
             ", expected 0 (contiguous) or >= ", width);
}

}  // namespace

void check_gla_args(const char* what, const GlaCore& a) {
  LOOM_CHECK(a.B >= 0 && a.T >= 0, what, ": B and T must be >= 0, got B ", a.B, " T ", a.T);
  LOOM_CHECK(a.H > 0 && a.Hkv > 0 && a.H % a.Hkv == 0, what,
             ": num_heads must be a positive multiple of num_kv_heads, got ", a.H, " and ", a.Hkv);
  LOOM_CHECK(a.K > 0 && a.V > 0, what, ": head dims must be > 0, got K ", a.K, " V ", a.V);
  LOOM_CHECK(a.chunk > 0 && a.sub_chunk > 0 && a.sub_chunk <= a.chunk, what,
             ": need 0 < sub_chunk <= chunk, got chunk ", a.chunk, " sub_chunk ", a.sub_chunk);
  check_ld(what, "q", a.q.ld, a.H * a.K);
  check_ld(what, "k", a.k.ld, a.Hkv * a.K);
  check_ld(what, "v", a.v.ld, a.Hkv * a.V);
  check_ld(what, "gk", a.gk.ld, a.Hkv * a.K);
}

HWY_EXPORT(gla_forward_impl);
HWY_EXPORT(gla_backward_impl);
HWY_EXPORT(gla_decay_total_impl);
HWY_EXPORT(gla_state_fold_impl);

void gla_decay_total(int64_t B, int64_t T, int64_t Hkv, int64_t K, const float* gk, float* decay) {
  LOOM_CHECK(B >= 0 && T >= 0 && Hkv > 0 && K > 0, "gla_decay_total: bad shape B ", B, " T ", T,
             " Hkv ", Hkv, " K ", K);
  LOOM_DISPATCH(gla_decay_total_impl)(B, T, Hkv, K, gk, decay);
}

void gla_state_fold(int64_t B, int64_t H, int64_t Hkv, int64_t K, int64_t V, const float* decay,
                    const float* E, float* S) {
  LOOM_CHECK(B >= 0 && H > 0 && Hkv > 0 && H % Hkv == 0 && K > 0 && V > 0,
             "gla_state_fold: bad shape B ", B, " H ", H, " Hkv ", Hkv, " K ", K, " V ", V);
  LOOM_DISPATCH(gla_state_fold_impl)(B, H, Hkv, K, V, decay, E, S);
}

void gla_forward(const GlaCore& a, GlaOut o, float* ht) {
  check_gla_args("gla_forward", a);
  check_ld("gla_forward", "o", o.ld, a.H * a.V);
  LOOM_DISPATCH(gla_forward_impl)(a, o, ht);
}

void gla_backward(const GlaCore& a, GlaIn dout, const float* dht, const GlaCoreGrads& g) {
  check_gla_args("gla_backward", a);
  check_ld("gla_backward", "dout", dout.ld, a.H * a.V);
  check_ld("gla_backward", "dq", g.dq.ld, a.H * a.K);
  check_ld("gla_backward", "dk", g.dk.ld, a.Hkv * a.K);
  check_ld("gla_backward", "dv", g.dv.ld, a.Hkv * a.V);
  check_ld("gla_backward", "dgk", g.dgk.ld, a.Hkv * a.K);
  LOOM_DISPATCH(gla_backward_impl)(a, dout, dht, g);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
