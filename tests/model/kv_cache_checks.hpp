#pragma once
// What the tests of generation with a KV cache share (tests/model/llama_inference_test.cpp,
// moe_inference_test.cpp; model/kv_cache.hpp): weights of unit scale, uniform random tokens, the
// cross-entropy of a sequence's logits against the training loss, the run of a prompt then single
// tokens, and the cache's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/philox.hpp"
#include "model/kv_cache.hpp"
#include "model/model.hpp"

namespace loom::test {

// Weights of unit scale (std 1/sqrt(fan-in), norms around 1, biases around 0), so every layer
// moves the logits: with the 0.02 training init the signal would be too small for a comparison to
// mean much.
inline void randomize_unit_scale(Model& m, uint64_t seed) {
  for (ParamUnit* u : m.units()) {
    for (auto& p : u->params()) {
      float* v = p.value.data<float>();
      const int64_t n = p.value.numel();
      const uint64_t key = philox_key(seed, p.spec.name);
      if (p.spec.shape.size() == 1) {
        const bool bias = p.spec.name.ends_with(".bias");
        philox_normal(key, 0, n, bias ? 0.0f : 1.0f, bias ? 0.5f : 0.2f, v);
      } else {
        const float fan_in = float(p.spec.shape[1]);
        // The embedding is read as activations (rows of unit norm-ish scale), the rest as maps.
        const bool is_embed = p.spec.name == "model.embed_tokens.weight";
        philox_normal(key, 0, n, 0.0f, is_embed ? 1.0f : 1.0f / std::sqrt(fan_in), v);
      }
    }
    u->refresh_bf16();
  }
}

inline std::vector<int32_t> uniform_tokens(int64_t n, int64_t V, uint64_t seed) {
  std::vector<float> u(static_cast<size_t>(n));
  philox_uniform(philox_key(seed, "tokens"), 0, n, u.data());
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[size_t(i)] = int32_t(u[size_t(i)] * float(V));
  return t;
}

// The cross-entropy of the logits `inf` (empty, of `model`, a vocabulary of V) gives T + 1 uniform
// tokens of `seed` (each position against the next token) equals the training forward's loss on
// them: both read the same units the same way.
inline void expect_training_loss(Model& model, KvCacheDecoder& inf, int64_t T, int64_t V,
                                 uint64_t seed) {
  const auto seq = uniform_tokens(T + 1, V, seed);
  const Tensor logits = inf.forward(seq.data(), T, true);
  double loss = 0;
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.data<float>() + t * V;
    double mx = -INFINITY, sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(l[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(l[v]) - mx);
    loss += mx + std::log(sum) - double(l[seq[size_t(t + 1)]]);
  }
  const double train = model.forward_backward(seq.data(), seq.data() + 1, 1, T, 1.0f);
  EXPECT_LT(std::abs(loss - train) / std::abs(train), 1e-5) << loss << " vs " << train;
}

// The logits [T, V] of `tokens`: the first `prompt` in one forward (prefill), then one at a time.
inline std::vector<float> prefill_then_decode(KvCacheDecoder& inf,
                                              const std::vector<int32_t>& tokens, int64_t prompt,
                                              int64_t V) {
  const int64_t T = int64_t(tokens.size());
  std::vector<float> out(size_t(T * V));
  const Tensor all = inf.forward(tokens.data(), prompt, true);
  EXPECT_EQ(all.shape(), (Shape{prompt, V}));
  std::copy(all.data<float>(), all.data<float>() + prompt * V, out.begin());
  for (int64_t t = prompt; t < T; ++t) {
    const Tensor last = inf.forward(&tokens[size_t(t)], 1);
    EXPECT_EQ(last.shape(), (Shape{V}));
    std::copy(last.data<float>(), last.data<float>() + V, out.begin() + t * V);
  }
  EXPECT_EQ(inf.length(), T);
  return out;
}

// `inf`, an empty cache of 8 positions of a vocabulary of V: a forward past the cache's end is
// refused (nothing cached by it), one up to the end runs, an id outside the vocabulary is refused.
inline void expect_cache_errors(KvCacheDecoder& inf, int64_t V, uint64_t seed) {
  ASSERT_EQ(inf.max_len(), 8);
  const auto tokens = uniform_tokens(9, V, seed);
  EXPECT_THROW(inf.forward(tokens.data(), 9), Error);  // beyond the cache
  inf.forward(tokens.data(), 6);
  EXPECT_THROW(inf.forward(tokens.data(), 3), Error);  // 6 + 3 > 8
  EXPECT_NO_THROW(inf.forward(tokens.data(), 2));
  inf.reset();
  const int32_t bad = int32_t(V);
  EXPECT_THROW(inf.forward(&bad, 1), Error);
}

}  // namespace loom::test
