#include "model/kv_cache.hpp"

namespace loom {

KvCacheDecoder::KvCacheDecoder(Model& model, const LlamaConfig& c, int64_t head_dim,
                               int64_t max_len)
    : compute_(model.compute_dtype()),
      device_(model.device()),
      c_(c),
      hd_(head_dim),
      max_len_(max_len),
      units_(model.units()) {
  LOOM_CHECK(max_len > 0 && max_len <= c.max_position_embeddings,
             "inference: cache length must be in [1, max_position_embeddings = ",
             c.max_position_embeddings, "], got ", max_len);
  LOOM_CHECK(ops::computes(device_), "inference: the model is on the ", device_name(device_),
             " device, where no kernel runs (expected cpu or cuda)");
  for (ParamUnit* u : units_) {
    LOOM_CHECK(u->flat().device() == device_, "inference: unit ", u->name(), " is on the ",
               device_name(u->flat().device()), " device, not the model's ", device_name(device_));
    LOOM_CHECK(!u->sharded(), "inference: unit ", u->name(),
               " is sharded (expected a model built whole on one process)");
  }
  const int64_t kv = c.num_key_value_heads * head_dim;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    caches_.push_back({f32({max_len, kv}), f32({max_len, kv})});
  rope_ = ops::rope_table(head_dim, max_len, c.rope_theta, c.rope_scaling, device_);
}

Tensor KvCacheDecoder::f32(const Shape& s) const {
  return Tensor::empty(s, DType::f32, device_);
}

Tensor KvCacheDecoder::gemm_input(const Tensor& x) {
  if (compute_ == DType::f32) return x;
  if (!lo_.defined() || lo_.numel() < x.numel())
    lo_ = Tensor::empty({x.numel()}, DType::bf16, device_);
  Tensor y = lo_.narrow(0, 0, x.numel()).view(x.shape());
  ops::cast(x, y);
  return y;
}

void KvCacheDecoder::attend(size_t layer, Tensor& qkv, Tensor& attn) {
  const int64_t Hkv = c_.num_key_value_heads, Hq = c_.num_attention_heads, hd = hd_;
  Cache& cache = caches_[layer];
  Tensor q = qkv.narrow(1, 0, Hq * hd), k = qkv.narrow(1, Hq * hd, Hkv * hd);
  const Tensor v = qkv.narrow(1, (Hq + Hkv) * hd, Hkv * hd);
  ops::rope_forward(q, 1, Hq, positions_, rope_);
  ops::rope_forward(k, 1, Hkv, positions_, rope_);
  Tensor kc = cache.k.narrow(0, len_, n_), vc = cache.v.narrow(0, len_, n_);
  ops::copy_rows(k, kc);
  ops::copy_rows(v, vc);
  // A prompt without a past: flash attention over the chunk; else the decode kernel over the
  // cache (any number of new rows).
  if (len_ == 0 && n_ > 1)
    ops::attention_forward(q, cache.k, cache.v, 1, Hq, Hkv, attn, lse_);
  else
    ops::attention_decode(q, cache.k, cache.v, len_ + n_, Hq, Hkv, attn);
}

Tensor KvCacheDecoder::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  LOOM_CHECK(n > 0, "inference: forward needs at least one token, got ", n);
  LOOM_CHECK(len_ + n <= max_len_, "inference: ", len_, " cached + ", n,
             " new positions exceed the cache length ", max_len_);
  const int64_t d = c_.hidden_size, V = c_.vocab_size;
  const float eps = float(c_.rms_norm_eps);
  n_ = n;
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) positions[size_t(t)] = int32_t(len_ + t);
  positions_ = ops::index_tensor(positions, device_, "position");
  if (len_ == 0 && n > 1) lse_ = f32({c_.num_attention_heads, n});

  const ParamUnit& embed = *units_.front();
  const ParamUnit& head = *units_.back();
  Tensor x = f32({n, d});
  ops::embedding_forward(ops::index_tensor({tokens, size_t(n)}, device_, "token", 0, V),
                         embed.params()[0].value, x);
  run_layers(x);
  len_ += n;

  // Head: only the rows whose logits are asked for go through the final norm and projection.
  const int64_t rows = all_logits ? n : 1;
  const Tensor xr = x.narrow(0, n - rows, rows);
  Tensor xf = f32({rows, d}), rstd = f32({rows});
  ops::rmsnorm_forward(xr, head.params()[0].value, eps, xf, rstd);
  const Tensor& w = c_.tie_word_embeddings ? embed.gemm_weight(0) : head.gemm_weight(1);
  if (!logits_.defined() || logits_.numel() < rows * V) logits_ = f32({rows * V});
  Tensor logits = logits_.narrow(0, 0, rows * V).view({rows, V});
  ops::linear(gemm_input(xf), w, logits);
  return all_logits ? logits : logits.view({V});
}

}  // namespace loom
