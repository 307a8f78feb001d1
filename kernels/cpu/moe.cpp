#include "kernels/cpu/moe.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.hpp"

// Plain C++ compiled for the baseline ISA: these kernels move rows and reduce short vectors, the
// memory traffic dominates. OpenMP splits tokens (or rows) among threads; each output element is
// computed by one thread in a fixed order, so the bits never depend on the thread count.

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMin = int64_t{1} << 14;

// Validates up front: an exception must not leave an OpenMP region.
void check_router(const char* what, int64_t M, int64_t E, int64_t k) {
  LOOM_CHECK(M >= 0, what, ": token count M must be >= 0, got ", M);
  LOOM_CHECK(E > 0, what, ": expert count E must be > 0, got ", E);
  LOOM_CHECK(k >= 1 && k <= E, what, ": k (experts per token) must be in [1, E = ", E, "], got ",
             k);
}

void check_experts(const char* what, const int32_t* experts, int64_t n, int64_t E) {
  for (int64_t a = 0; a < n; ++a)
    if (experts[a] < 0 || experts[a] >= E)
      fail(what, ": expert index ", experts[a], " at assignment ", a, " is out of range [0, ", E,
           ")");
}

// pos [M*k] in [-1, N): -1 a dropped choice.
void check_pos(const char* what, const int32_t* pos, int64_t n, int64_t N) {
  for (int64_t a = 0; a < n; ++a)
    if (pos[a] < -1 || pos[a] >= N)
      fail(what, ": row ", pos[a], " of assignment ", a, " is out of range [-1, ", N,
           ") (-1: dropped)");
}

void check_rows(const char* what, int64_t M, int64_t N, int64_t k, int64_t d) {
  LOOM_CHECK(M >= 0 && N >= 0, what, ": row counts must be >= 0, got M ", M, ", N ", N);
  LOOM_CHECK(k >= 1, what, ": k (experts per token) must be >= 1, got ", k);
  LOOM_CHECK(d > 0, what, ": row width d must be > 0, got ", d);
}

template <class T>
void dispatch_t(const T* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                T* xs) {
  check_rows("moe_dispatch", M, N, k, d);
  for (int64_t i = 0; i < N; ++i)
    if (order[i] < 0 || order[i] >= M * k)
      fail("moe_dispatch: assignment ", order[i], " at row ", i,
           " is out of range [0, M*k = ", M * k, ")");
#pragma omp parallel for schedule(static) if (N * d >= kParallelMin)
  for (int64_t i = 0; i < N; ++i)
    std::memcpy(xs + i * d, x + int64_t(order[i] / k) * d, size_t(d) * sizeof(T));
}

template <class Y>
void combine_t(const Y* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
               int64_t k, int64_t d, float* y) {
  check_rows("moe_combine", M, N, k, d);
  check_pos("moe_combine", pos, M * k, N);
#pragma omp parallel for schedule(static) if (M * k * d >= kParallelMin)
  for (int64_t t = 0; t < M; ++t) {
    float* __restrict yt = y + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const float w = weights[t * k + j];
      const Y* __restrict r = ys + int64_t(p) * d;
      for (int64_t c = 0; c < d; ++c) yt[c] += w * load_f32(r[c]);
    }
  }
}

template <class Y, class D>
void combine_backward_t(const float* dy, const Y* ys, int64_t N, const float* weights,
                        const int32_t* pos, int64_t M, int64_t k, int64_t d, D* dys,
                        float* dweights) {
  check_rows("moe_combine_backward", M, N, k, d);
  check_pos("moe_combine_backward", pos, M * k, N);
#pragma omp parallel for schedule(static) if (M * k * d >= kParallelMin)
  for (int64_t t = 0; t < M; ++t) {
    const float* __restrict g = dy + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) {
        dweights[t * k + j] = 0.0f;
        continue;
      }
      const float w = weights[t * k + j];
      const Y* __restrict r = ys + int64_t(p) * d;
      D* __restrict out = dys + int64_t(p) * d;
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) {
        dot += double(g[c]) * double(load_f32(r[c]));
        store_f32(out[c], w * g[c]);
      }
      dweights[t * k + j] = float(dot);
    }
  }
}

}  // namespace

void moe_route(const float* logits, const float* bias, int64_t M, int64_t E, int64_t k,
               bool renormalize, float* probs, int32_t* experts, float* weights, float* prob_sum) {
  check_router("moe_route", M, E, k);
  LOOM_CHECK(E <= std::numeric_limits<int32_t>::max(), "moe_route: E = ", E,
             " experts do not fit the int32 expert indices");
#pragma omp parallel if (M * E >= kParallelMin)
  {
    std::vector<float> score(static_cast<size_t>(E));
    std::vector<uint8_t> taken(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; ++t) {
      // No __restrict: probs may be logits. Each logit is read before its probability is written.
      const float* x = logits + t * E;
      float* p = probs + t * E;
      float m = x[0];
      for (int64_t e = 1; e < E; ++e) m = std::max(m, x[e]);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) {
        const float ex = std::exp(x[e] - m);
        p[e] = ex;
        sum += double(ex);
      }
      for (int64_t e = 0; e < E; ++e) {
        p[e] = float(double(p[e]) / sum);
        score[size_t(e)] = bias ? p[e] + bias[e] : p[e];
        taken[size_t(e)] = 0;
      }
      // k passes of an argmax over the experts not taken yet: strict > keeps the lower index on
      // a tie (and some index even where scores are NaN).
      int32_t* ex = experts + t * k;
      float* w = weights + t * k;
      float s = 0;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[size_t(e)] && (best < 0 || score[size_t(e)] > score[size_t(best)])) best = e;
        taken[size_t(best)] = 1;
        ex[j] = int32_t(best);
        w[j] = p[best];
        s += p[best];
      }
      if (renormalize)
        for (int64_t j = 0; j < k; ++j) w[j] /= s;
    }
  }
  if (prob_sum) {
    // Column sums in token order, in double, each added to prob_sum once: serial, a pass over
    // M*E floats that stays in cache for the router's sizes.
    std::vector<double> acc(static_cast<size_t>(E), 0.0);
    for (int64_t t = 0; t < M; ++t)
      for (int64_t e = 0; e < E; ++e) acc[size_t(e)] += double(probs[t * E + e]);
    for (int64_t e = 0; e < E; ++e) prob_sum[e] = float(double(prob_sum[e]) + acc[size_t(e)]);
  }
}

void moe_route_backward(const float* probs, const int32_t* experts, const float* weights,
                        const float* dweights, int64_t M, int64_t E, int64_t k, bool renormalize,
                        const float* dprob, float* dlogits) {
  check_router("moe_route_backward", M, E, k);
  check_experts("moe_route_backward", experts, M * k, E);
#pragma omp parallel if (M * E >= kParallelMin)
  {
    std::vector<double> dp(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; ++t) {
      // No __restrict: dlogits may be probs. The row of probs is read whole before it is written.
      const float* p = probs + t * E;
      const int32_t* ex = experts + t * k;
      const float* w = weights + t * k;
      const float* dw = dweights + t * k;
      float* out = dlogits + t * E;
      for (int64_t e = 0; e < E; ++e) dp[size_t(e)] = dprob ? double(dprob[e]) : 0.0;
      if (renormalize) {
        float s = 0;  // the forward's sum, in its order
        for (int64_t j = 0; j < k; ++j) s += p[ex[j]];
        double c = 0;
        for (int64_t j = 0; j < k; ++j) c += double(dw[j]) * double(w[j]);
        for (int64_t j = 0; j < k; ++j) dp[size_t(ex[j])] += (double(dw[j]) - c) / double(s);
      } else {
        for (int64_t j = 0; j < k; ++j) dp[size_t(ex[j])] += double(dw[j]);
      }
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += double(p[e]) * dp[size_t(e)];
      for (int64_t e = 0; e < E; ++e) out[e] = float(double(p[e]) * (dp[size_t(e)] - dot));
    }
  }
}

int64_t moe_permute(const int32_t* experts, int64_t M, int64_t k, int64_t E, int64_t capacity,
                    int64_t* counts, int32_t* pos) {
  LOOM_CHECK(capacity >= 0, "moe_permute: capacity must be >= 0 (0: keep every row), got ",
             capacity);
  if (capacity == 0) return moe_permute_per_expert(experts, M, k, E, nullptr, counts, pos);
  const std::vector<int64_t> each(static_cast<size_t>(std::max<int64_t>(E, 0)), capacity);
  return moe_permute_per_expert(experts, M, k, E, each.data(), counts, pos);
}

int64_t moe_permute_per_expert(const int32_t* experts, int64_t M, int64_t k, int64_t E,
                               const int64_t* capacity, int64_t* counts, int32_t* pos) {
  check_router("moe_permute", M, E, k);
  if (capacity)
    for (int64_t e = 0; e < E; ++e)
      LOOM_CHECK(capacity[e] >= 0, "moe_permute: expert ", e, "'s capacity must be >= 0, got ",
                 capacity[e]);
  const int64_t n = M * k;
  LOOM_CHECK(n <= std::numeric_limits<int32_t>::max(), "moe_permute: M*k = ", n,
             " assignments do not fit the int32 rows of pos and order");
  std::vector<int64_t> total(static_cast<size_t>(E), 0);
  for (int64_t a = 0; a < n; ++a) {
    if (experts[a] < 0 || experts[a] >= E)
      fail("moe_permute: expert index ", experts[a], " at assignment ", a, " is out of range [0, ",
           E, ")");
    ++total[size_t(experts[a])];
  }
  std::vector<int64_t> start(static_cast<size_t>(E)), next(static_cast<size_t>(E), 0);
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    counts[e] = capacity ? std::min(total[size_t(e)], capacity[e]) : total[size_t(e)];
    start[size_t(e)] = rows;
    rows += counts[e];
  }
  int64_t dropped = 0;
  for (int64_t a = 0; a < n; ++a) {
    const size_t e = size_t(experts[a]);
    if (next[e] < counts[e]) {
      pos[a] = int32_t(start[e] + next[e]++);
    } else {
      pos[a] = -1;
      ++dropped;
    }
  }
  return dropped;
}

void moe_permute_order(const int32_t* pos, int64_t n, int64_t N, int32_t* order) {
  LOOM_CHECK(n >= 0 && N >= 0 && N <= n, "moe_permute_order: ", N, " rows of ", n,
             " assignments (0 <= N <= assignments)");
  check_pos("moe_permute_order", pos, n, N);
  std::fill(order, order + N, -1);
  for (int64_t a = 0; a < n; ++a) {
    if (pos[a] < 0) continue;
    LOOM_CHECK(order[pos[a]] < 0, "moe_permute_order: assignments ", order[pos[a]], " and ", a,
               " both at row ", pos[a]);
    order[pos[a]] = int32_t(a);
  }
  for (int64_t i = 0; i < N; ++i)
    LOOM_CHECK(order[i] >= 0, "moe_permute_order: no assignment at row ", i, " of ", N);
}

void moe_dispatch(const float* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  float* xs) {
  dispatch_t(x, M, d, order, N, k, xs);
}
void moe_dispatch(const bf16* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  bf16* xs) {
  dispatch_t(x, M, d, order, N, k, xs);
}

void moe_dispatch_backward(const float* dxs, int64_t N, const int32_t* pos, int64_t M, int64_t k,
                           int64_t d, float* dx, bool accumulate) {
  check_rows("moe_dispatch_backward", M, N, k, d);
  check_pos("moe_dispatch_backward", pos, M * k, N);
#pragma omp parallel for schedule(static) if (M * k * d >= kParallelMin)
  for (int64_t t = 0; t < M; ++t) {
    float* __restrict r = dx + t * d;
    if (!accumulate) std::fill(r, r + d, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const float* __restrict src = dxs + int64_t(p) * d;
      for (int64_t c = 0; c < d; ++c) r[c] += src[c];
    }
  }
}

void moe_combine(const float* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y) {
  combine_t(ys, N, weights, pos, M, k, d, y);
}
void moe_combine(const bf16* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y) {
  combine_t(ys, N, weights, pos, M, k, d, y);
}

void moe_combine_backward(const float* dy, const float* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, float* dys,
                          float* dweights) {
  combine_backward_t(dy, ys, N, weights, pos, M, k, d, dys, dweights);
}
void moe_combine_backward(const float* dy, const bf16* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, float* dys,
                          float* dweights) {
  combine_backward_t(dy, ys, N, weights, pos, M, k, d, dys, dweights);
}
void moe_combine_backward(const float* dy, const float* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, bf16* dys,
                          float* dweights) {
  combine_backward_t(dy, ys, N, weights, pos, M, k, d, dys, dweights);
}
void moe_combine_backward(const float* dy, const bf16* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, bf16* dys,
                          float* dweights) {
  combine_backward_t(dy, ys, N, weights, pos, M, k, d, dys, dweights);
}

}  // namespace loom::cpu
