// Parity against an independent PyTorch implementation (tests/parity/torch_llama.py, Debian's
// python3-torch): same config.json, same safetensors weights, same tokens; loss and every
// parameter gradient must agree.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/philox.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace loom;
namespace fs = std::filesystem;

namespace {

struct Case {
  LlamaConfig config;
  int64_t B, T;
};

LlamaConfig small_config(bool tied, bool llama3_rope) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 136;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 301;  // odd on purpose
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000;
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = 1024;
  if (llama3_rope) {
    c.rope_scaling.llama3 = true;
    c.rope_scaling.factor = 8;
    c.rope_scaling.low_freq_factor = 1;
    c.rope_scaling.high_freq_factor = 4;
    c.rope_scaling.original_max_position = 64;  // small, so all three regimes occur at T=37
  }
  return c;
}

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s ? s : ".";
}

struct Run {
  double loss;
  std::vector<NamedTensor> grads;
};

// Writes the model, tokens and config to `dir`, runs loom's forward/backward and returns its loss
// (mean over tokens) and gradients.
Run run_loom(const Case& k, DType compute, const fs::path& dir, bool write_files) {
  LlamaModel model(k.config, compute);
  model.init_weights(7);
  // Perturb the norm weights so their gradients are not the trivial all-ones case.
  for (ParamUnit* u : model.units())
    for (auto& p : u->params())
      if (p.spec.init == Init::ones) {
        std::vector<float> r(size_t(p.value.numel()));
        philox_normal(philox_key(9, p.spec.name), 0, int64_t(r.size()), 1.0f, 0.1f, r.data());
        std::copy(r.begin(), r.end(), p.value.data<float>());
      }
  for (ParamUnit* u : model.units()) u->refresh_bf16();
  const int64_t B = k.B, T = k.T, V = k.config.vocab_size;
  std::vector<float> r(size_t(B * (T + 1)));
  philox_uniform(philox_key(11, "parity.tokens"), 0, int64_t(r.size()), r.data());
  std::vector<int32_t> rows(r.size()), in(size_t(B * T)), tg(size_t(B * T));
  for (size_t i = 0; i < r.size(); ++i) rows[i] = int32_t(r[i] * V);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in[b * T + t] = rows[b * (T + 1) + t];
      tg[b * T + t] = rows[b * (T + 1) + t + 1];
    }
  if (write_files) {
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << k.config.to_json();
    std::vector<NamedTensor> w;
    for (ParamUnit* u : model.units())
      for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
    write_safetensors((dir / "model.safetensors").string(), w);
    std::ofstream tok(dir / "tokens.bin", std::ios::binary);
    tok.write(reinterpret_cast<const char*>(rows.data()), std::streamsize(rows.size() * 4));
    std::ofstream(dir / "tokens.json") << "{\"batch\": " << B << ", \"seq_len\": " << T << "}";
  }
  model.zero_grad();
  Run out;
  out.loss = model.forward_backward(in.data(), tg.data(), B, T, 1.0f / float(B * T)) / (B * T);
  for (ParamUnit* u : model.units())
    for (auto& p : u->params()) out.grads.push_back({p.spec.name, p.grad});
  return out;
}

void run_torch(const fs::path& dir, const std::string& dtype) {
  const std::string cmd = "/usr/bin/python3 " + source_dir() +
                          "/tests/parity/torch_llama.py --dir " + dir.string() + " --dtype " +
                          dtype + " > " + (dir / "torch.log").string() + " 2>&1";
  int rc = std::system(cmd.c_str());
  std::ifstream log(dir / "torch.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << "the PyTorch reference failed (is python3-torch installed? scripts/deps.sh "
                      "installs it):\n"
                   << cmd << "\n"
                   << text;
}

void check_parity(const Case& k, const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("loom_parity_" + name);
  fs::remove_all(dir);
  Run loom = run_loom(k, DType::f32, dir, true);
  run_torch(dir, "float32");
  SafetensorsFile ref((dir / "torch_out.safetensors").string());
  float torch_loss;
  ref.read_f32("loss", {1}, &torch_loss);
  EXPECT_LE(std::abs(loom.loss - torch_loss) / std::abs(torch_loss), 1e-5)
      << "loom " << loom.loss << " torch " << torch_loss;
  for (auto& g : loom.grads) {
    std::vector<float> want(size_t(g.tensor.numel()));
    ref.read_f32(g.name, g.tensor.shape(), want.data());
    const float* got = g.tensor.data<float>();
    double err = test::rel_l2(std::vector<float>(got, got + want.size()), want);
    EXPECT_LE(err, 1e-4) << g.name;
  }

  // bf16 GEMMs (fp32 accumulation) against PyTorch under bf16 autocast.
  Run bf = run_loom(k, DType::bf16, dir, false);
  run_torch(dir, "bfloat16");
  SafetensorsFile ref_bf((dir / "torch_out.safetensors").string());
  float torch_bf;
  ref_bf.read_f32("loss", {1}, &torch_bf);
  EXPECT_LE(std::abs(bf.loss - torch_bf) / std::abs(torch_bf), 2e-2);
  EXPECT_LE(std::abs(bf.loss - torch_loss) / std::abs(torch_loss), 2e-2);
  fs::remove_all(dir);
}

}  // namespace

TEST(TorchParity, UntiedGqa) {
  check_parity({small_config(false, false), 3, 37}, "untied");
}

TEST(TorchParity, TiedWithLlama3RopeScaling) {
  check_parity({small_config(true, true), 2, 45}, "tied_llama3");
}
