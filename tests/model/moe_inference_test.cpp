// Generation of a mixture of experts with a KV cache (model/moe_inference.hpp) against the
// training model's forward of the whole sequence on the same weights: the prefill's and every
// decode step's logits, for the three families' debug shapes (tests/parity/*.json: Qwen3-MoE with
// q/k norms, head_dim free of hidden / heads and a dense first layer; Qwen2-MoE with q/k/v biases,
// a shared expert and no renormalization; Mixtral, tied, every layer sparse). The training
// forward is checked against PyTorch by tests/model/moe_parity_test.cpp.
#include "model/moe_inference.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "core/read_file.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

MoeConfig debug_config(const std::string& file) {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  const std::string path = std::string(s ? s : ".") + "/tests/parity/" + file;
  return MoeConfig::from_json(read_file(path), path);
}

// Weights of unit scale (std 1/sqrt(fan-in), norms and biases around 1 and 0), so every layer and
// the router move the logits and the routing differs from token to token; with the 0.02 training
// init the signal would be too small for a comparison to mean much.
void randomize(MoeModel& m, uint64_t seed) {
  for (ParamUnit* u : m.units()) {
    for (auto& p : u->params()) {
      float* v = p.value.data<float>();
      const int64_t n = p.value.numel();
      const uint64_t key = philox_key(seed, p.spec.name);
      if (p.spec.shape.size() == 1) {
        const bool bias = p.spec.name.ends_with(".bias");
        philox_normal(key, 0, n, bias ? 0.0f : 1.0f, bias ? 0.5f : 0.2f, v);
      } else {
        const bool is_embed = p.spec.name == "model.embed_tokens.weight";
        const float fan_in = float(p.spec.shape[1]);
        philox_normal(key, 0, n, 0.0f, is_embed ? 1.0f : 1.0f / std::sqrt(fan_in), v);
      }
    }
    u->refresh_bf16();
  }
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  std::vector<float> u(static_cast<size_t>(n));
  philox_uniform(philox_key(seed, "tokens"), 0, n, u.data());
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[size_t(i)] = int32_t(u[size_t(i)] * float(V));
  return t;
}

const Param& param(MoeModel& m, const std::string& name) {
  for (ParamUnit* u : m.units())
    for (auto& p : u->params())
      if (p.spec.name == name) return p;
  throw Error("no parameter " + name);
}

// The logits [T, V] of every position by the training model: its forward through the blocks
// (what the loss is computed from), then the head's norm and projection in fp64.
std::vector<double> training_logits(MoeModel& m, const std::vector<int32_t>& tokens) {
  const LlamaConfig& c = m.config().base;
  const int64_t T = int64_t(tokens.size()), d = c.hidden_size, V = c.vocab_size;
  ActivationStore s = m.micro_batch(tokens.data(), tokens.data(), 1, T, 1.0f);
  const Tensor h = m.forward(s, 0, m.num_units() - 1);
  const float* x = h.data<float>();
  const float* norm = param(m, "model.norm.weight").value.data<float>();
  const float* w = param(m, c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight")
                       .value.data<float>();
  std::vector<double> logits(size_t(T * V)), xn(static_cast<size_t>(d));
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(x[t * d + i]) * x[t * d + i];
    const double r = 1.0 / std::sqrt(ss / double(d) + c.rms_norm_eps);
    for (int64_t i = 0; i < d; ++i) xn[size_t(i)] = x[t * d + i] * r * norm[i];
    for (int64_t v = 0; v < V; ++v) {
      double a = 0;
      for (int64_t i = 0; i < d; ++i) a += xn[size_t(i)] * w[v * d + i];
      logits[size_t(t * V + v)] = a;
    }
  }
  return logits;
}

struct RowError {
  double rel, max_abs;
};
// The logits of positions [t0, t0 + rows) against the reference's rows: relative L2 and the
// largest absolute difference.
RowError row_error(const Tensor& got, const std::vector<double>& ref, int64_t t0, int64_t rows,
                   int64_t V) {
  const float* g = got.data<float>();
  std::vector<double> want(ref.begin() + t0 * V, ref.begin() + (t0 + rows) * V);
  double mx = 0;
  for (size_t i = 0; i < want.size(); ++i) mx = std::max(mx, std::abs(double(g[i]) - want[i]));
  return {test::rel_l2(std::vector<float>(g, g + rows * V), want), mx};
}

// f32 through three layers of unit-scale activations: ~1e-6 relative; a wrong position, cache row,
// expert, routing weight, norm or bias is a 1e-1 error (a token routed to another expert: one
// position far off).
constexpr double kTol = 1e-5;

void check_against_training(const std::string& file, uint64_t seed) {
  const MoeConfig c = debug_config(file);
  MoeModel model(c, DType::f32);
  randomize(model, seed);
  const int64_t T = 29, prompt = 11, V = c.base.vocab_size;
  const auto tokens = random_tokens(T, V, seed);
  const std::vector<double> ref = training_logits(model, tokens);

  MoeInference inf(model, 40);
  double worst = 0, worst_abs = 0;
  auto check = [&](const Tensor& got, int64_t t0, int64_t rows, const std::string& what) {
    const RowError e = row_error(got, ref, t0, rows, V);
    EXPECT_LT(e.rel, kTol) << file << ": " << what << " (max abs " << e.max_abs << ")";
    worst = std::max(worst, e.rel);
    worst_abs = std::max(worst_abs, e.max_abs);
  };
  // Prefill: every position's logits, then the decode steps one token at a time.
  Tensor all = inf.forward(tokens.data(), prompt, true);
  ASSERT_EQ(all.shape(), (Shape{prompt, V}));
  check(all, 0, prompt, "prefill");
  for (int64_t t = prompt; t < T; ++t) {
    Tensor last = inf.forward(&tokens[size_t(t)], 1);
    ASSERT_EQ(last.shape(), (Shape{V}));
    check(last, t, 1, "position " + std::to_string(t));
  }
  EXPECT_EQ(inf.length(), T);
  // Chunks of several tokens after a past (the decode kernel with several rows, the router on
  // several tokens), after a reset.
  inf.reset();
  int64_t t = 0;
  for (int64_t n : {1, 4, 3, 1, 7, 2, 5, 6}) {
    Tensor part = inf.forward(&tokens[size_t(t)], n, true);
    check(part, t, n, "chunk at " + std::to_string(t));
    t += n;
  }
  EXPECT_EQ(t, T);
  std::printf("  %s: %ld positions, logits rel-L2 <= %.2e, max abs diff %.2e\n", file.c_str(),
              long(T), worst, worst_abs);
}

}  // namespace

TEST(MoeInference, Qwen3MoeMatchesTrainingForward) {
  check_against_training("moe_debug.json", 1);
}
TEST(MoeInference, Qwen2MoeMatchesTrainingForward) {
  check_against_training("moe_qwen2_debug.json", 2);
}
TEST(MoeInference, MixtralMatchesTrainingForward) {
  check_against_training("moe_mixtral_debug.json", 3);
}

TEST(MoeInference, LossEqualsTrainingLoss) {
  // The cross-entropy of the inference logits equals the training loss on the same tokens (the
  // fused loss of the head; without the auxiliary term, which only training adds).
  MoeConfig c = debug_config("moe_qwen2_debug.json");
  c.output_router_logits = false;
  MoeModel model(c, DType::f32);
  randomize(model, 4);
  const int64_t T = 31, V = c.base.vocab_size;
  const auto seq = random_tokens(T + 1, V, 4);
  MoeInference inf(model, T);
  Tensor logits = inf.forward(seq.data(), T, true);
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

TEST(MoeInference, Bf16CloseToF32) {
  // bf16 weights and GEMM inputs (8-bit mantissa, ~4e-3 per rounding) against the f32 training
  // forward of the master weights: a few 1e-3 relative over all positions, more where a token near
  // a tie routes to another expert; a wrong layout would be O(1).
  const MoeConfig c = debug_config("moe_debug.json");
  MoeModel model(c, DType::bf16);
  randomize(model, 5);
  MoeModel f32_model(c, DType::f32);
  randomize(f32_model, 5);
  const int64_t T = 17, prompt = 10, V = c.base.vocab_size;
  const auto tokens = random_tokens(T, V, 5);
  const std::vector<double> ref = training_logits(f32_model, tokens);
  MoeInference inf(model, T);
  std::vector<float> got(size_t(T * V));
  Tensor all = inf.forward(tokens.data(), prompt, true);
  std::copy(all.data<float>(), all.data<float>() + prompt * V, got.begin());
  for (int64_t t = prompt; t < T; ++t) {
    Tensor last = inf.forward(&tokens[size_t(t)], 1);
    std::copy(last.data<float>(), last.data<float>() + V, got.begin() + t * V);
  }
  const double err = test::rel_l2(got, ref);
  std::printf("  bf16 against f32: logits rel-L2 %.2e\n", err);
  EXPECT_LT(err, 5e-2);
}

TEST(MoeInference, Errors) {
  const MoeConfig c = debug_config("moe_debug.json");
  MoeModel model(c, DType::f32);
  randomize(model, 7);
  EXPECT_THROW(MoeInference(model, c.base.max_position_embeddings + 1), Error);
  EXPECT_THROW(MoeInference(model, 0), Error);
  MoeInference inf(model, 8);
  const auto tokens = random_tokens(9, c.base.vocab_size, 7);
  EXPECT_THROW(inf.forward(tokens.data(), 9), Error);  // beyond the cache
  inf.forward(tokens.data(), 6);
  EXPECT_THROW(inf.forward(tokens.data(), 3), Error);  // 6 + 3 > 8
  EXPECT_NO_THROW(inf.forward(tokens.data(), 2));
  inf.reset();
  const int32_t bad = int32_t(c.base.vocab_size);
  EXPECT_THROW(inf.forward(&bad, 1), Error);
}
