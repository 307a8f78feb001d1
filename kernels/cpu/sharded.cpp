#include "kernels/cpu/sharded.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace loom::cpu {

void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
               int64_t width) {
  LOOM_CHECK(rows >= 0 && width >= 0 && src_stride >= width && dst_stride >= width,
             "copy_rows: rows ", rows, ", width ", width, ", strides ", src_stride, " and ",
             dst_stride, " (need strides >= width >= 0)");
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < rows; ++m) std::copy_n(src + m * src_stride, width, dst + m * dst_stride);
}

void fill(float* x, int64_t n, float value) {
  std::fill_n(x, n, value);
}

void embedding_forward_range(const int32_t* tokens, int64_t n, const float* table, int64_t v0,
                             int64_t vocab, int64_t dim, float* out) {
#pragma omp parallel for
  for (int64_t m = 0; m < n; ++m) {
    const int64_t t = int64_t(tokens[m]) - v0;
    if (t >= 0 && t < vocab)
      std::copy_n(table + t * dim, dim, out + m * dim);
    else
      std::fill_n(out + m * dim, dim, 0.0f);
  }
}

void embedding_backward_range(const int32_t* tokens, int64_t n, const float* dout, int64_t v0,
                              int64_t vocab, int64_t dim, float* dtable) {
  for (int64_t m = 0; m < n; ++m) {
    const int64_t t = int64_t(tokens[m]) - v0;
    if (t < 0 || t >= vocab) continue;
    float* gr = dtable + t * dim;
    const float* sr = dout + m * dim;
    for (int64_t i = 0; i < dim; ++i) gr[i] += sr[i];
  }
}

void vocab_shard_lse(const float* logits, int64_t rows, int64_t V, int64_t Vr,
                     const int32_t* targets, int64_t v0, float* lse, float* target_logit) {
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    const float* l = logits + i * V;
    float mx = -INFINITY;
    for (int64_t v = 0; v < Vr; ++v) mx = std::max(mx, l[v]);
    double s = 0;
    for (int64_t v = 0; v < Vr; ++v) s += std::exp(double(l[v] - mx));
    // A rank holding padding only adds nothing to the log-sum-exp (exp(-inf) = 0).
    lse[i] = Vr > 0 ? float(double(mx) + std::log(s)) : -INFINITY;
    const int64_t t = int64_t(targets[i]);
    target_logit[i] = (t >= v0 && t < v0 + V) ? l[t - v0] : 0.0f;
  }
}

double vocab_shard_combine(const float* lse_all, int n, int64_t N, const int32_t* targets,
                           const float* target_logit, float* glse) {
  double loss = 0;
  for (int64_t i = 0; i < N; ++i) {
    float mx = -INFINITY;
    for (int r = 0; r < n; ++r) mx = std::max(mx, lse_all[r * N + i]);
    double s = 0;
    for (int r = 0; r < n; ++r) s += std::exp(double(lse_all[r * N + i] - mx));
    glse[i] = float(double(mx) + std::log(s));
    if (targets[i] >= 0) loss += double(glse[i]) - double(target_logit[i]);
  }
  return loss;
}

void vocab_shard_dlogits(float* logits, int64_t rows, int64_t V, int64_t Vr, const int32_t* targets,
                         int64_t v0, const float* glse, float grad_scale) {
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    float* l = logits + i * V;
    const int64_t t = int64_t(targets[i]);
    if (t < 0) {
      std::fill_n(l, V, 0.0f);
      continue;
    }
    const float g = glse[i];
    for (int64_t v = 0; v < Vr; ++v) l[v] = std::exp(l[v] - g) * grad_scale;
    std::fill(l + Vr, l + V, 0.0f);
    if (t >= v0 && t < v0 + V) l[t - v0] -= grad_scale;
  }
}

}  // namespace loom::cpu
