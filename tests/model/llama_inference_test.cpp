// Generation with a KV cache against a naive fp64 forward of the whole sequence on the same
// weights, against the training forward's loss, and the sampler's rules.
#include "model/llama_inference.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "core/philox.hpp"
#include "kernels/cpu/rope.hpp"
#include "tests/model/kv_cache_checks.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

LlamaConfig tiny_config(bool tied, bool llama3_rope) {
  LlamaConfig c;
  c.hidden_size = 96;
  c.intermediate_size = 160;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;  // grouped-query; head dim 24 (not a multiple of 16)
  c.vocab_size = 211;         // odd on purpose
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.tie_word_embeddings = tied;
  if (llama3_rope) {
    c.rope_scaling.llama3 = true;
    c.rope_scaling.factor = 8;
    c.rope_scaling.low_freq_factor = 1;
    c.rope_scaling.high_freq_factor = 4;
    c.rope_scaling.original_max_position = 16;  // small, so all three regimes occur
  }
  return c;
}

using test::uniform_tokens;

using Mat = std::vector<double>;

const float* weight(LlamaModel& m, const std::string& name) {
  for (ParamUnit* u : m.units())
    for (auto& p : u->params())
      if (p.spec.name == name) return p.value.data<float>();
  ADD_FAILURE() << "no parameter " << name;
  return nullptr;
}

// y[t, :] = x[t, :] W^T with W [N, K].
Mat matmul_t(const Mat& x, int64_t T, int64_t K, const float* w, int64_t N) {
  Mat y(size_t(T * N), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double a = 0;
      for (int64_t k = 0; k < K; ++k) a += x[t * K + k] * double(w[n * K + k]);
      y[t * N + n] = a;
    }
  return y;
}

Mat rmsnorm(const Mat& x, int64_t T, int64_t d, const float* w, double eps) {
  Mat y(x.size());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += x[t * d + i] * x[t * d + i];
    const double r = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[t * d + i] = x[t * d + i] * r * double(w[i]);
  }
  return y;
}

// Rotates heads of x [T, H*hd] in place at positions 0..T-1 (rotate_half convention).
void rope(Mat& x, int64_t T, int64_t H, int64_t hd, const std::vector<double>& inv_freq) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        double* a = &x[(t * H + h) * hd + i];
        double* b = a + half;
        const double c = std::cos(double(t) * inv_freq[i]), s = std::sin(double(t) * inv_freq[i]);
        const double x1 = *a, x2 = *b;
        *a = x1 * c - x2 * s;
        *b = x2 * c + x1 * s;
      }
}

// The logits [T, V] of every position of `tokens`, by the textbook forward in fp64.
Mat naive_logits(LlamaModel& m, const std::vector<int32_t>& tokens) {
  const LlamaConfig& c = m.config();
  const int64_t T = int64_t(tokens.size()), d = c.hidden_size, hd = c.head_dim();
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, G = Hq / Hkv;
  const int64_t F = c.intermediate_size, V = c.vocab_size;
  const std::vector<double> inv_freq = cpu::rope_inv_freq(hd, c.rope_theta, c.rope_scaling);
  const float* emb = weight(m, "model.embed_tokens.weight");
  Mat x(size_t(T * d));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < d; ++i) x[t * d + i] = emb[tokens[size_t(t)] * d + i];
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Mat xn = rmsnorm(x, T, d, weight(m, p + "input_layernorm.weight"), c.rms_norm_eps);
    Mat q = matmul_t(xn, T, d, weight(m, p + "self_attn.q_proj.weight"), Hq * hd);
    Mat k = matmul_t(xn, T, d, weight(m, p + "self_attn.k_proj.weight"), Hkv * hd);
    Mat v = matmul_t(xn, T, d, weight(m, p + "self_attn.v_proj.weight"), Hkv * hd);
    rope(q, T, Hq, hd, inv_freq);
    rope(k, T, Hkv, hd, inv_freq);
    Mat att(size_t(T * Hq * hd), 0.0);
    std::vector<double> s(static_cast<size_t>(T));
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < T; ++i) {
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double a = 0;
          for (int64_t e = 0; e < hd; ++e)
            a += q[(i * Hq + h) * hd + e] * k[(j * Hkv + h / G) * hd + e];
          s[j] = a / std::sqrt(double(hd));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t e = 0; e < hd; ++e)
            att[(i * Hq + h) * hd + e] += std::exp(s[j] - mx) / sum * v[(j * Hkv + h / G) * hd + e];
      }
    Mat o = matmul_t(att, T, Hq * hd, weight(m, p + "self_attn.o_proj.weight"), d);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    xn = rmsnorm(x, T, d, weight(m, p + "post_attention_layernorm.weight"), c.rms_norm_eps);
    Mat g = matmul_t(xn, T, d, weight(m, p + "mlp.gate_proj.weight"), F);
    Mat u = matmul_t(xn, T, d, weight(m, p + "mlp.up_proj.weight"), F);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    Mat dn = matmul_t(g, T, F, weight(m, p + "mlp.down_proj.weight"), d);
    for (size_t i = 0; i < x.size(); ++i) x[i] += dn[i];
  }
  Mat xf = rmsnorm(x, T, d, weight(m, "model.norm.weight"), c.rms_norm_eps);
  return matmul_t(xf, T, d,
                  weight(m, c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"),
                  V);
}

// Relative L2 error of the logits of positions [t0, t0 + rows) against the reference rows.
double row_error(const float* got, const Mat& ref, int64_t t0, int64_t rows, int64_t V) {
  std::vector<double> want(ref.begin() + t0 * V, ref.begin() + (t0 + rows) * V);
  return test::rel_l2(std::vector<float>(got, got + rows * V), want);
}

void check_against_naive(bool tied, bool llama3, uint64_t seed) {
  const LlamaConfig c = tiny_config(tied, llama3);
  LlamaModel model(c, DType::f32);
  test::randomize_unit_scale(model, seed);
  const int64_t T = 23, prompt = 9, V = c.vocab_size;
  const auto tokens = uniform_tokens(T, V, seed);
  const Mat ref = naive_logits(model, tokens);

  LlamaInference inf(model, 40);
  // Prefill: every position's logits, then the decode steps one token at a time. f32 through
  // two layers of unit-scale activations: ~1e-6 relative; a wrong position, mask or cache row
  // is a 1e-1 error.
  Tensor all = inf.forward(tokens.data(), prompt, true);
  ASSERT_EQ(all.shape(), (Shape{prompt, V}));
  EXPECT_LT(row_error(all.data<float>(), ref, 0, prompt, V), 1e-5) << "prefill";
  for (int64_t t = prompt; t < T; ++t) {
    Tensor last = inf.forward(&tokens[size_t(t)], 1);
    ASSERT_EQ(last.shape(), (Shape{V}));
    EXPECT_LT(row_error(last.data<float>(), ref, t, 1, V), 1e-5) << "position " << t;
  }
  EXPECT_EQ(inf.length(), T);

  // Chunks of several tokens after a past (the decode kernel with Tq > 1), after a reset.
  inf.reset();
  int64_t t = 0;
  for (int64_t n : {1, 4, 3, 1, 7, 2, 5}) {
    Tensor part = inf.forward(&tokens[size_t(t)], n, true);
    EXPECT_LT(row_error(part.data<float>(), ref, t, n, V), 1e-5) << "chunk at " << t;
    t += n;
  }
  EXPECT_EQ(t, T);
}

}  // namespace

TEST(LlamaInference, MatchesNaiveFp64Untied) {
  check_against_naive(false, false, 1);
}
TEST(LlamaInference, MatchesNaiveFp64TiedLlama3Rope) {
  check_against_naive(true, true, 2);
}

TEST(LlamaInference, LossEqualsTrainingForward) {
  // The cross-entropy of the inference logits equals the training forward's loss on the same
  // tokens: both read the same units the same way.
  const LlamaConfig c = tiny_config(false, true);
  LlamaModel model(c, DType::f32);
  test::randomize_unit_scale(model, 3);
  LlamaInference inf(model, 31);
  test::expect_training_loss(model, inf, 31, c.vocab_size, 3);
}

TEST(LlamaInference, Bf16CloseToNaive) {
  // bf16 weights and GEMM inputs (8-bit mantissa, ~4e-3 per rounding) against the fp64 forward
  // of the f32 master weights: a few 1e-3 relative after two layers; a wrong layout would be
  // O(1).
  const LlamaConfig c = tiny_config(false, false);
  LlamaModel model(c, DType::bf16);
  test::randomize_unit_scale(model, 4);
  const int64_t T = 17, V = c.vocab_size;
  const auto tokens = uniform_tokens(T, V, 4);
  const Mat ref = naive_logits(model, tokens);
  LlamaInference inf(model, T);
  Tensor all = inf.forward(tokens.data(), 10, true);
  EXPECT_LT(row_error(all.data<float>(), ref, 0, 10, V), 3e-2);
  for (int64_t t = 10; t < T; ++t) {
    Tensor last = inf.forward(&tokens[size_t(t)], 1);
    EXPECT_LT(row_error(last.data<float>(), ref, t, 1, V), 3e-2) << "position " << t;
  }
}

TEST(LlamaInference, Errors) {
  const LlamaConfig c = tiny_config(false, false);
  LlamaModel model(c, DType::f32);
  test::randomize_unit_scale(model, 5);
  EXPECT_THROW(LlamaInference(model, c.max_position_embeddings + 1), Error);
  EXPECT_THROW(LlamaInference(model, 0), Error);
  LlamaInference inf(model, 8);
  test::expect_cache_errors(inf, c.vocab_size, 5);
}

TEST(Sampling, TemperatureZeroIsArgmax) {
  Sampler s(7, 0.0f, 0.5f);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto logits = test::randn(1000, seed, 3.0f);
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    EXPECT_EQ(s.sample(logits.data(), 1000), best);
  }
  std::vector<float> tie{1, 5, 2, 5, -INFINITY, NAN};
  EXPECT_EQ(s.sample(tie.data(), 6), 1);  // the first of equal maxima; NaN never wins
  EXPECT_EQ(argmax(tie.data(), 6), 1);
  std::vector<float> none{NAN, -INFINITY};
  EXPECT_THROW(argmax(none.data(), 2), Error);
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingP) {
  const std::vector<float> p{0.1f, 0.4f, 0.2f, 0.3f};
  EXPECT_EQ(top_p_set(p.data(), 4, 0.65f), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(top_p_set(p.data(), 4, 0.4f), (std::vector<int32_t>{1}));
  EXPECT_EQ(top_p_set(p.data(), 4, 0.75f), (std::vector<int32_t>{1, 3, 2}));
  EXPECT_EQ(top_p_set(p.data(), 4, 1e-6f), (std::vector<int32_t>{1}));
  EXPECT_EQ(top_p_set(p.data(), 4, 1.0f).size(), 4u);
  // Random distributions, flat ones too (the set grows past the first sorted prefix): the set is
  // the most probable tokens in order, reaches p, and is minimal (without its last token it
  // would not reach p).
  for (uint64_t seed = 0; seed < 12; ++seed) {
    const int64_t n = 5000;
    auto l = test::randn(size_t(n), seed, seed % 2 ? 3.0f : 0.1f);
    double sum = 0;
    for (float& x : l) sum += (x = std::exp(x));
    for (float& x : l) x = float(x / sum);
    const float top_p = 0.3f + 0.05f * float(seed);
    const auto set = top_p_set(l.data(), n, top_p);
    ASSERT_FALSE(set.empty());
    double mass = 0;
    std::vector<bool> in(size_t(n), false);
    for (size_t i = 0; i < set.size(); ++i) {
      mass += l[size_t(set[i])];
      in[size_t(set[i])] = true;
      if (i > 0) {
        EXPECT_GE(l[size_t(set[i - 1])], l[size_t(set[i])]);
      }
    }
    EXPECT_GE(mass, top_p);
    EXPECT_LT(mass - l[size_t(set.back())], top_p);
    const float smallest = l[size_t(set.back())];
    for (int64_t i = 0; i < n; ++i)
      if (!in[size_t(i)]) {
        EXPECT_LE(l[size_t(i)], smallest);
      }
  }
}

TEST(Sampling, FrequenciesFollowTheTemperedDistribution) {
  // 40000 draws from softmax(l / 0.7) over 6 tokens, then with top-p 0.8: each frequency within
  // 5 standard deviations of its probability (sd <= 0.0025), and nothing outside the top-p set.
  const std::vector<float> logits{1.0f, 2.0f, 0.5f, 1.5f, -1.0f, 0.0f};
  const float temp = 0.7f;
  std::vector<double> p(6);
  double z = 0;
  for (int i = 0; i < 6; ++i) z += (p[size_t(i)] = std::exp(double(logits[size_t(i)]) / temp));
  for (double& x : p) x /= z;
  const int n = 40000;
  for (float top_p : {1.0f, 0.8f}) {
    std::vector<float> pf(p.begin(), p.end());
    const auto set = top_p_set(pf.data(), 6, top_p);
    double mass = 0;
    std::vector<double> want(6, 0.0);
    for (int32_t i : set) mass += p[size_t(i)];
    for (int32_t i : set) want[size_t(i)] = p[size_t(i)] / mass;
    Sampler s(11, temp, top_p);
    std::vector<int> count(6, 0);
    for (int k = 0; k < n; ++k) ++count[size_t(s.sample(logits.data(), 6))];
    for (int i = 0; i < 6; ++i) {
      const double f = double(count[size_t(i)]) / n;
      const double sd = std::sqrt(want[size_t(i)] * (1 - want[size_t(i)]) / n);
      EXPECT_NEAR(f, want[size_t(i)], 5 * sd + 1e-12) << "token " << i << " top_p " << top_p;
    }
  }
}

TEST(Sampling, FixedSeedGivesTheSameTokens) {
  // Generation end to end (prefill, decode, sampling): the same seed gives the same tokens, a
  // different seed other tokens.
  const LlamaConfig c = tiny_config(true, false);
  LlamaModel model(c, DType::f32);
  // The training init (std 0.02): nearly flat distributions, so the draws decide the tokens.
  model.init_weights(6);
  auto generate = [&](uint64_t seed) {
    LlamaInference inf(model, 48);
    Sampler s(seed, 1.0f, 0.95f);
    std::vector<int32_t> out = uniform_tokens(5, c.vocab_size, 6);
    Tensor logits = inf.forward(out.data(), 5);
    for (int i = 0; i < 40; ++i) {
      out.push_back(s.sample(logits.data<float>(), c.vocab_size));
      logits = inf.forward(&out.back(), 1);
    }
    return out;
  };
  const auto a = generate(42), b = generate(42), other = generate(43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
}

TEST(Sampling, RejectsBadSettings) {
  EXPECT_THROW(Sampler(1, -0.1f, 0.9f), Error);
  EXPECT_THROW(Sampler(1, NAN, 0.9f), Error);
  EXPECT_THROW(Sampler(1, 1.0f, 0.0f), Error);
  EXPECT_THROW(Sampler(1, 1.0f, 1.5f), Error);
}
