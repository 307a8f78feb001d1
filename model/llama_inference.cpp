#include "model/llama_inference.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/philox.hpp"
#include "ops/ops.hpp"

namespace loom {

LlamaInference::LlamaInference(LlamaModel& model, int64_t max_len)
    : KvCacheDecoder(model, model.config(), model.config().head_dim(), max_len),
      c_(model.config()) {
  LOOM_CHECK(int64_t(units().size()) == c_.num_hidden_layers + 2, "inference: expected ",
             c_.num_hidden_layers + 2, " parameter units, got ", units().size());
}

void LlamaInference::run_layers(Tensor& x) {
  const int64_t n = x.size(0), d = c_.hidden_size, hd = c_.head_dim();
  const int64_t Hq = c_.num_attention_heads, Hkv = c_.num_key_value_heads;
  const int64_t F = c_.intermediate_size, nqkv = (Hq + 2 * Hkv) * hd;
  const float eps = float(c_.rms_norm_eps);
  Tensor xn = f32({n, d}), rstd = f32({n});
  Tensor qkv = f32({n, nqkv}), attn = f32({n, Hq * hd});
  Tensor gu = f32({n, 2 * F}), act = f32({n, F});
  for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
    const ParamUnit& u = *units()[size_t(l + 1)];
    const auto& P = u.params();
    // Attention: x += o(attention(rope(qkv(norm1(x))))), with this chunk's k, v appended to the
    // cache first.
    ops::rmsnorm_forward(x, P[kNorm1].value, eps, xn, rstd);
    ops::linear(gemm_input(xn), u.gemm_weight(kQ), qkv);
    attend(size_t(l), qkv, attn);
    ops::linear(gemm_input(attn), u.gemm_weight(kO), x, true);
    // MLP: x += down(silu(gate) * up), gate and up from one fused GEMM.
    ops::rmsnorm_forward(x, P[kNorm2].value, eps, xn, rstd);
    ops::linear(gemm_input(xn), u.gemm_weight(kGate), gu);
    ops::swiglu_forward(gu, act);
    ops::linear(gemm_input(act), u.gemm_weight(kDown), x, true);
  }
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i]) && (best < 0 || x[i] > x[best])) best = i;
  LOOM_CHECK(best >= 0, "argmax: none of the ", n, " logits is finite");
  return int32_t(best);
}

std::vector<int32_t> top_p_set(const float* probs, int64_t n, float top_p) {
  LOOM_CHECK(n > 0, "top_p_set: no probabilities");
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto before = [probs](int32_t a, int32_t b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  };
  // Usually a few tokens hold the mass: sort a growing prefix of the most probable instead of
  // all n (a vocabulary of 128K would cost milliseconds per token).
  double mass = 0;
  int64_t sorted = 0;
  for (int64_t k = std::min<int64_t>(n, 64);; k = std::min(n, k * 8)) {
    if (k < n) std::nth_element(order.begin() + sorted, order.begin() + k, order.end(), before);
    std::sort(order.begin() + sorted, order.begin() + k, before);
    for (int64_t i = sorted; i < k; ++i) {
      mass += probs[order[size_t(i)]];
      if (mass >= top_p) {
        order.resize(size_t(i + 1));
        return order;
      }
    }
    sorted = k;
    if (k == n) return order;  // rounding left the total just under top_p: everything
  }
}

Sampler::Sampler(uint64_t seed, float temperature, float top_p)
    : key_(philox_key(seed, "loom.generate.sample")), temperature_(temperature), top_p_(top_p) {
  LOOM_CHECK(std::isfinite(temperature) && temperature >= 0,
             "sampling: temperature must be finite and >= 0, got ", temperature);
  LOOM_CHECK(top_p > 0 && top_p <= 1, "sampling: top-p must be in (0, 1], got ", top_p);
}

int32_t Sampler::sample(const float* logits, int64_t V) {
  const int64_t draw = draws_++;
  const int32_t best = argmax(logits, V);
  if (temperature_ == 0) return best;
  probs_.resize(size_t(V));
  const float mx = logits[best], inv_t = 1.0f / temperature_;
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float p = std::isfinite(logits[i]) ? std::exp((logits[i] - mx) * inv_t) : 0.0f;
    probs_[size_t(i)] = p;
    sum += p;
  }
  const float inv_sum = float(1.0 / sum);
  for (float& p : probs_) p *= inv_sum;
  float u;
  philox_uniform(key_, draw, 1, &u);
  if (top_p_ >= 1) {
    order_.resize(size_t(V));
    std::iota(order_.begin(), order_.end(), 0);
  } else {
    order_ = top_p_set(probs_.data(), V, top_p_);
  }
  double mass = 0;
  for (int32_t i : order_) mass += probs_[size_t(i)];
  const double target = double(u) * mass;
  double cum = 0;
  for (int32_t i : order_) {
    cum += probs_[size_t(i)];
    if (target < cum) return i;
  }
  return order_.back();
}

}  // namespace loom
