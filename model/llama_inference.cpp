#include "model/llama_inference.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/philox.hpp"
#include "ops/ops.hpp"

namespace loom {

LlamaInference::LlamaInference(LlamaModel& model, int64_t max_len)
    : c_(model.config()),
      compute_(model.compute_dtype()),
      device_(model.device()),
      max_len_(max_len) {
  LOOM_CHECK(max_len > 0 && max_len <= c_.max_position_embeddings,
             "inference: cache length must be in [1, max_position_embeddings = ",
             c_.max_position_embeddings, "], got ", max_len);
  std::vector<ParamUnit*> units = model.units();
  LOOM_CHECK(int64_t(units.size()) == c_.num_hidden_layers + 2, "inference: expected ",
             c_.num_hidden_layers + 2, " parameter units, got ", units.size());
  LOOM_CHECK(ops::computes(device_), "inference: the model is on the ", device_name(device_),
             " device, where no kernel runs (expected cpu or cuda)");
  for (ParamUnit* u : units)
    LOOM_CHECK(u->flat().device() == device_, "inference: unit ", u->name(), " is on the ",
               device_name(u->flat().device()), " device, not the model's ", device_name(device_));
  embed_ = units.front();
  head_ = units.back();
  const int64_t kv = c_.num_key_value_heads * c_.head_dim();
  for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
    layers_.push_back({units[size_t(l + 1)], f32({max_len, kv}), f32({max_len, kv})});
  rope_ = ops::rope_table(c_.head_dim(), max_len, c_.rope_theta, c_.rope_scaling);
}

Tensor LlamaInference::f32(const Shape& s) const {
  return Tensor::empty(s, DType::f32, device_);
}

Tensor LlamaInference::gemm_input(const Tensor& x, Tensor& scratch) const {
  if (compute_ == DType::f32) return x;
  if (!scratch.defined() || scratch.numel() < x.numel())
    scratch = Tensor::empty({x.numel()}, DType::bf16, device_);
  Tensor y = scratch.narrow(0, 0, x.numel()).view(x.shape());
  ops::cast(x, y);
  return y;
}

Tensor LlamaInference::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  LOOM_CHECK(n > 0, "inference: forward needs at least one token, got ", n);
  LOOM_CHECK(len_ + n <= max_len_, "inference: ", len_, " cached + ", n,
             " new positions exceed the cache length ", max_len_);
  const int64_t d = c_.hidden_size, hd = c_.head_dim(), V = c_.vocab_size;
  const int64_t Hq = c_.num_attention_heads, Hkv = c_.num_key_value_heads;
  const int64_t F = c_.intermediate_size, nqkv = (Hq + 2 * Hkv) * hd;
  const float eps = float(c_.rms_norm_eps);

  Tensor x = f32({n, d}), xn = f32({n, d}), rstd = f32({n});
  Tensor qkv = f32({n, nqkv}), attn = f32({n, Hq * hd});
  Tensor gu = f32({n, 2 * F}), act = f32({n, F}), lo;  // lo: rounded GEMM inputs (bf16)
  Tensor lse;
  const bool prefill = len_ == 0 && n > 1;  // flash attention over the prompt, no past
  if (prefill) lse = f32({Hq, n});
  positions_.resize(size_t(n));
  for (int64_t t = 0; t < n; ++t) positions_[size_t(t)] = int32_t(len_ + t);
  Tensor q = qkv.narrow(1, 0, Hq * hd), k = qkv.narrow(1, Hq * hd, Hkv * hd);
  const Tensor v = qkv.narrow(1, (Hq + Hkv) * hd, Hkv * hd);

  ops::embedding_forward(tokens, embed_->params()[0].value, x);
  for (Layer& layer : layers_) {
    const ParamUnit& u = *layer.unit;
    const auto& P = u.params();
    // Attention: x += o(attention(rope(qkv(norm1(x))))), with this chunk's k, v appended to the
    // cache first.
    ops::rmsnorm_forward(x, P[kNorm1].value, eps, xn, rstd);
    ops::linear(gemm_input(xn, lo), u.gemm_weight(kQ), qkv);
    ops::rope_forward(q, 1, Hq, positions_, rope_);
    ops::rope_forward(k, 1, Hkv, positions_, rope_);
    Tensor kc = layer.k.narrow(0, len_, n), vc = layer.v.narrow(0, len_, n);
    ops::copy_rows(k, kc);
    ops::copy_rows(v, vc);
    if (prefill)
      ops::attention_forward(q, layer.k, layer.v, 1, Hq, Hkv, attn, lse);
    else
      ops::attention_decode(q, layer.k, layer.v, len_ + n, Hq, Hkv, attn);
    ops::linear(gemm_input(attn, lo), u.gemm_weight(kO), x, true);
    // MLP: x += down(silu(gate) * up), gate and up from one fused GEMM.
    ops::rmsnorm_forward(x, P[kNorm2].value, eps, xn, rstd);
    ops::linear(gemm_input(xn, lo), u.gemm_weight(kGate), gu);
    ops::swiglu_forward(gu, act);
    ops::linear(gemm_input(act, lo), u.gemm_weight(kDown), x, true);
  }
  len_ += n;

  // Head: only the rows whose logits are asked for go through the final norm and projection.
  const int64_t rows = all_logits ? n : 1;
  const Tensor xr = x.narrow(0, n - rows, rows);
  Tensor xf = f32({rows, d}), rstd_r = rstd.narrow(0, 0, rows);
  ops::rmsnorm_forward(xr, head_->params()[0].value, eps, xf, rstd_r);
  const Tensor& w = c_.tie_word_embeddings ? embed_->gemm_weight(0) : head_->gemm_weight(1);
  if (!logits_.defined() || logits_.numel() < rows * V) logits_ = f32({rows * V});
  Tensor logits = logits_.narrow(0, 0, rows * V).view({rows, V});
  ops::linear(gemm_input(xf, lo), w, logits);
  return all_logits ? logits : logits.view({V});
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
