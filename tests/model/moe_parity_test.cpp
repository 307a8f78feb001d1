// Mixture-of-experts parity against an independent PyTorch implementation written from the
// Hugging Face modeling semantics (tests/parity/torch_moe.py, Debian's python3-torch): the same
// config.json, safetensors weights and tokens; the loss (cross-entropy plus the auxiliary
// load-balancing term), the auxiliary loss itself and every parameter gradient must agree, in f32
// and under bf16 autocast.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/philox.hpp"
#include "model/moe.hpp"
#include "model/safetensors.hpp"
#include "tests/model/tiny_moe.hpp"
#include "tests/test_util.hpp"

using namespace loom;
namespace fs = std::filesystem;

namespace {

MoeConfig qwen3_moe() {
  // head_dim 24: not hidden / heads, as Qwen3's; a dense first layer of ffn 96.
  MoeConfig c =
      test::TinyMoe{.hidden = 64, .ffn = 96, .head_dim = 24, .moe_ffn = 40, .vocab = 301}.config();
  c.mlp_only_layers = {0};
  c.router_aux_loss_coef = 0.01;  // larger than the default, so that the term shows
  c.output_router_logits = true;
  return c;
}

MoeConfig mixtral() {
  MoeConfig c = test::TinyMoe{.family = MoeConfig::Family::mixtral,
                              .hidden = 48,
                              .ffn = 56,
                              .layers = 2,
                              .kv_heads = 4,
                              .head_dim = 12,
                              .experts = 4,
                              .vocab = 257}
                    .config();
  c.base.rms_norm_eps = 1e-5;
  c.base.tie_word_embeddings = true;
  // Large, so that the auxiliary loss's gradient dominates the routers' (a wrong scale fails).
  c.router_aux_loss_coef = 0.5;
  c.output_router_logits = true;
  return c;
}

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s ? s : ".";
}

struct Run {
  double loss, aux;
  std::vector<NamedTensor> grads;
};

// Writes the model, tokens and config to `dir` (with write_files), runs loom's forward/backward
// and returns its loss (mean over tokens, with the auxiliary term), the auxiliary loss and the
// gradients.
Run run_loom(const MoeConfig& c, int64_t B, int64_t T, DType compute, const fs::path& dir,
             bool write_files) {
  MoeModel model(c, compute);
  model.init_weights(7);
  // Perturb the norm weights so their gradients are not the trivial all-ones case, and the biases
  // (zeros at first) so that they add something.
  for (ParamUnit* u : model.units())
    for (auto& p : u->params())
      if (p.spec.init == Init::ones || p.spec.name.ends_with(".bias")) {
        std::vector<float> r(size_t(p.value.numel()));
        const float mean = p.spec.init == Init::ones ? 1.0f : 0.0f;
        philox_normal(philox_key(9, p.spec.name), 0, int64_t(r.size()), mean, 0.1f, r.data());
        std::copy(r.begin(), r.end(), p.value.data<float>());
      }
  for (ParamUnit* u : model.units()) u->refresh_bf16();
  const int64_t V = c.base.vocab_size;
  std::vector<float> r(size_t(B * (T + 1)));
  philox_uniform(philox_key(11, "parity.tokens"), 0, int64_t(r.size()), r.data());
  std::vector<int32_t> rows(r.size()), in(size_t(B * T)), tg(size_t(B * T));
  for (size_t i = 0; i < r.size(); ++i) rows[i] = int32_t(r[i] * float(V));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in[size_t(b * T + t)] = rows[size_t(b * (T + 1) + t)];
      tg[size_t(b * T + t)] = rows[size_t(b * (T + 1) + t + 1)];
    }
  if (write_files) {
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << c.to_json();
    std::vector<NamedTensor> w;
    for (ParamUnit* u : model.units())
      for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
    write_safetensors((dir / "model.safetensors").string(), w);
    std::ofstream tok(dir / "tokens.bin", std::ios::binary);
    tok.write(reinterpret_cast<const char*>(rows.data()), std::streamsize(rows.size() * 4));
    std::ofstream(dir / "tokens.json") << "{\"batch\": " << B << ", \"seq_len\": " << T << "}";
  }
  model.zero_grad();
  ActivationStore s = model.micro_batch(in.data(), tg.data(), B, T, 1.0f / float(B * T));
  model.backward(s, 0, model.num_units(), model.forward(s, 0, model.num_units()));
  Run out;
  out.loss = model.loss(s) / double(B * T);
  out.aux = MoeModel::aux_loss(s);
  for (ParamUnit* u : model.units())
    for (auto& p : u->params()) out.grads.push_back({p.spec.name, p.grad});
  return out;
}

void run_torch(const fs::path& dir, const std::string& dtype) {
  const std::string cmd = "/usr/bin/python3 " + source_dir() + "/tests/parity/torch_moe.py --dir " +
                          dir.string() + " --dtype " + dtype + " > " +
                          (dir / "torch.log").string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir / "torch.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << "the PyTorch reference failed (is python3-torch installed? scripts/test.sh "
                      "installs it):\n"
                   << cmd << "\n"
                   << text;
}

double scalar(const SafetensorsFile& f, const char* name) {
  float v = 0;
  f.read_f32(name, {1}, &v);
  return double(v);
}

void check_parity(const MoeConfig& c, int64_t B, int64_t T, const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("loom_moe_parity_" + name);
  fs::remove_all(dir);
  const Run loom = run_loom(c, B, T, DType::f32, dir, true);
  run_torch(dir, "float32");
  SafetensorsFile ref((dir / "torch_out.safetensors").string());
  const double torch_loss = scalar(ref, "loss"), torch_aux = scalar(ref, "aux_loss");
  EXPECT_LE(std::abs(loom.loss - torch_loss) / std::abs(torch_loss), 1e-5)
      << "loom " << loom.loss << " torch " << torch_loss;
  EXPECT_LE(std::abs(loom.aux - torch_aux) / std::abs(torch_aux), 1e-5)
      << "aux: loom " << loom.aux << " torch " << torch_aux;
  // The term is in the loss (a balanced router's aux is about k = num_experts_per_tok).
  EXPECT_GT(torch_aux, 0.5 * double(c.num_experts_per_tok));
  double worst = 0;
  std::string worst_name;
  for (const auto& g : loom.grads) {
    std::vector<float> want(size_t(g.tensor.numel()));
    ref.read_f32(g.name, g.tensor.shape(), want.data());
    const float* got = g.tensor.data<float>();
    const double err = test::rel_l2(std::vector<float>(got, got + want.size()), want);
    EXPECT_LE(err, 1e-4) << g.name;
    if (err > worst) worst = err, worst_name = g.name;
  }
  std::printf(
      "  %s f32: loss %.8f (torch %.8f), aux %.6f (torch %.6f), %zu gradients, worst "
      "rel-L2 %.2e (%s)\n",
      name.c_str(), loom.loss, torch_loss, loom.aux, torch_aux, loom.grads.size(), worst,
      worst_name.c_str());

  // bf16 GEMMs (fp32 accumulation) against PyTorch under bf16 autocast.
  const Run bf = run_loom(c, B, T, DType::bf16, dir, false);
  run_torch(dir, "bfloat16");
  SafetensorsFile ref_bf((dir / "torch_out.safetensors").string());
  const double torch_bf = scalar(ref_bf, "loss");
  std::printf("  %s bf16: loss %.6f (torch autocast %.6f)\n", name.c_str(), bf.loss, torch_bf);
  EXPECT_LE(std::abs(bf.loss - torch_bf) / std::abs(torch_bf), 2e-2);
  EXPECT_LE(std::abs(bf.loss - torch_loss) / std::abs(torch_loss), 2e-2);
  fs::remove_all(dir);
}

}  // namespace

TEST(MoeTorchParity, Qwen3MoeDenseFirstLayer) {
  check_parity(qwen3_moe(), 3, 37, "qwen3_moe");
}

TEST(MoeTorchParity, Qwen3MoeWithoutRenormalization) {
  MoeConfig c = qwen3_moe();
  c.norm_topk_prob = false;
  c.mlp_only_layers = {};
  c.decoder_sparse_step = 2;  // layers 1 sparse, 0 and 2 dense
  check_parity(c, 2, 29, "qwen3_moe_sparse_step");
}

// Qwen2-MoE: q/k/v biases, the shared expert with its sigmoid gate, no q/k norms.
TEST(MoeTorchParity, Qwen2MoeSharedExpert) {
  MoeConfig c = qwen3_moe();
  c.family = MoeConfig::Family::qwen2_moe;
  c.head_dim = 16;  // hidden / heads
  c.shared_expert_intermediate_size = 56;
  c.norm_topk_prob = false;
  check_parity(c, 2, 33, "qwen2_moe");
}

TEST(MoeTorchParity, MixtralTied) {
  check_parity(mixtral(), 2, 41, "mixtral");
}
