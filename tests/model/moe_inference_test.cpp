// Generation of a mixture of experts with a KV cache (model/moe_inference.hpp) against the
// training model's forward of the whole sequence on the same weights: the prefill's and every
// decode step's logits, for the three families' debug shapes (tests/parity/*.json: Qwen3-MoE with
// q/k norms, head_dim set apart from hidden / heads, and a dense first layer; Qwen2-MoE with q/k/v
// biases, a shared expert and no renormalization; Mixtral, tied, every layer sparse). The training
// forward is checked against PyTorch by tests/model/moe_parity_test.cpp.
#include "model/moe_inference.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/read_file.hpp"
#include "tests/model/kv_cache_checks.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

MoeConfig debug_config(const std::string& file) {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  const std::string path = std::string(s ? s : ".") + "/tests/parity/" + file;
  return MoeConfig::from_json(read_file(path), path);
}

using test::uniform_tokens;

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
RowError row_error(const float* got, const std::vector<double>& ref, int64_t t0, int64_t rows,
                   int64_t V) {
  std::vector<double> want(ref.begin() + t0 * V, ref.begin() + (t0 + rows) * V);
  double mx = 0;
  for (size_t i = 0; i < want.size(); ++i) mx = std::max(mx, std::abs(double(got[i]) - want[i]));
  return {test::rel_l2(std::vector<float>(got, got + rows * V), want), mx};
}

// f32 through three layers of unit-scale activations: ~1e-6 relative; a wrong position, cache row,
// expert, routing weight, norm or bias is a 1e-1 error (a token routed to another expert: one
// position far off).
constexpr double kTol = 1e-5;

void check_against_training(const MoeConfig& c, const std::string& file, uint64_t seed) {
  MoeModel model(c, DType::f32);
  test::randomize_unit_scale(model, seed);
  const int64_t T = 29, prompt = 11, V = c.base.vocab_size;
  const auto tokens = uniform_tokens(T, V, seed);
  const std::vector<double> ref = training_logits(model, tokens);

  MoeInference inf(model, 40);
  double worst = 0, worst_abs = 0;
  auto check = [&](const float* got, int64_t t0, int64_t rows, const std::string& what) {
    const RowError e = row_error(got, ref, t0, rows, V);
    EXPECT_LT(e.rel, kTol) << file << ": " << what << " (max abs " << e.max_abs << ")";
    worst = std::max(worst, e.rel);
    worst_abs = std::max(worst_abs, e.max_abs);
  };
  // Prefill: every position's logits, then the decode steps one token at a time.
  const std::vector<float> got = test::prefill_then_decode(inf, tokens, prompt, V);
  check(got.data(), 0, prompt, "prefill");
  for (int64_t t = prompt; t < T; ++t)
    check(got.data() + t * V, t, 1, "position " + std::to_string(t));
  // Chunks of several tokens after a past (the decode kernel with several rows, the router on
  // several tokens), after a reset.
  inf.reset();
  int64_t t = 0;
  for (int64_t n : {1, 4, 3, 1, 7, 2, 5, 6}) {
    const Tensor part = inf.forward(&tokens[size_t(t)], n, true);
    check(part.data<float>(), t, n, "chunk at " + std::to_string(t));
    t += n;
  }
  EXPECT_EQ(t, T);
  std::printf("  %s: %ld positions, logits rel-L2 <= %.2e, max abs diff %.2e\n", file.c_str(),
              long(T), worst, worst_abs);
}

}  // namespace

TEST(MoeInference, Qwen3MoeMatchesTrainingForward) {
  MoeConfig c = debug_config("moe_debug.json");
  c.head_dim = 24;  // not hidden / heads = 16, as Qwen3's
  check_against_training(c, "moe_debug.json, head_dim 24", 1);
}
TEST(MoeInference, Qwen2MoeMatchesTrainingForward) {
  check_against_training(debug_config("moe_qwen2_debug.json"), "moe_qwen2_debug.json", 2);
}
TEST(MoeInference, MixtralMatchesTrainingForward) {
  check_against_training(debug_config("moe_mixtral_debug.json"), "moe_mixtral_debug.json", 3);
}

TEST(MoeInference, LossEqualsTrainingLoss) {
  // The cross-entropy of the inference logits equals the training loss on the same tokens (the
  // fused loss of the head; without the auxiliary term, which only training adds).
  MoeConfig c = debug_config("moe_qwen2_debug.json");
  c.output_router_logits = false;
  MoeModel model(c, DType::f32);
  test::randomize_unit_scale(model, 4);
  MoeInference inf(model, 31);
  test::expect_training_loss(model, inf, 31, c.base.vocab_size, 4);
}

TEST(MoeInference, Bf16CloseToF32) {
  // bf16 weights and GEMM inputs (8-bit mantissa, ~4e-3 per rounding) against the f32 training
  // forward of the master weights: a few 1e-3 relative over all positions, more where a token near
  // a tie routes to another expert; a wrong layout would be O(1).
  const MoeConfig c = debug_config("moe_debug.json");
  MoeModel model(c, DType::bf16);
  test::randomize_unit_scale(model, 5);
  MoeModel f32_model(c, DType::f32);
  test::randomize_unit_scale(f32_model, 5);
  const int64_t T = 17, prompt = 10, V = c.base.vocab_size;
  const auto tokens = uniform_tokens(T, V, 5);
  const std::vector<double> ref = training_logits(f32_model, tokens);
  MoeInference inf(model, T);
  const double err = test::rel_l2(test::prefill_then_decode(inf, tokens, prompt, V), ref);
  std::printf("  bf16 against f32: logits rel-L2 %.2e\n", err);
  EXPECT_LT(err, 5e-2);
}

TEST(MoeInference, Errors) {
  const MoeConfig c = debug_config("moe_debug.json");
  MoeModel model(c, DType::f32);
  test::randomize_unit_scale(model, 7);
  EXPECT_THROW(MoeInference(model, c.base.max_position_embeddings + 1), Error);
  EXPECT_THROW(MoeInference(model, 0), Error);
  MoeInference inf(model, 8);
  test::expect_cache_errors(inf, c.base.vocab_size, 7);
  // A model sharded as FSDP holds a part of each unit: refused, naming the unit.
  MoeModel sharded(c, DType::f32, Device::cpu, ShardLayout{.rank = 0, .count = 2});
  try {
    MoeInference bad(sharded, 8);
    ADD_FAILURE() << "a sharded model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unit embed is sharded"), std::string::npos) << e.what();
  }
}
