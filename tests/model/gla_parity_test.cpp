// GLA parity against an independent PyTorch implementation (tests/parity/torch_gla.py, Debian's
// python3-torch 1.13, written from the spec's equations): same config.json, same safetensors
// weights, same tokens; loss and every parameter gradient must agree in fp32.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/philox.hpp"
#include "model/gla.hpp"
#include "model/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace loom;
namespace fs = std::filesystem;

namespace {

GlaConfig small_config(bool tied, bool conv = false) {
  GlaConfig c;
  c.hidden_size = 64;
  c.num_hidden_layers = 2;
  c.num_heads = tied ? 2 : 4;
  c.num_kv_heads = 2;  // GQA (G = 2) untied, plain heads tied
  c.intermediate_size = 96;
  c.vocab_size = 301;  // odd on purpose
  c.tie_word_embeddings = tied;
  if (tied) {  // the other variants: no output gate (plain g_norm), clamp_min active
    c.use_output_gate = false;
    c.has_clamp_min = true;
    c.clamp_min = -0.045;
  }
  c.use_short_conv = conv;
  c.conv_size = 3;
  return c;
}

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s ? s : ".";
}

void check_parity(const GlaConfig& config, int64_t B, int64_t T, const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("loom_gla_parity_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  GlaModel model(config, DType::f32);
  model.init_weights(7);
  // Norm weights (ones) and the gate bias (zeros) perturbed, so their gradients are not the
  // trivial case and the decay varies per channel.
  for (ParamUnit* u : model.units())
    for (auto& p : u->params())
      if (p.spec.init == Init::ones || p.spec.std == 0) {
        std::vector<float> r(size_t(p.value.numel()));
        philox_normal(philox_key(9, p.spec.name), 0, int64_t(r.size()),
                      p.spec.init == Init::ones ? 1.0f : 0.0f, 0.5f, r.data());
        std::copy(r.begin(), r.end(), p.value.data<float>());
      }
  const int64_t V = config.vocab_size;
  std::vector<float> r(size_t(B * (T + 1)));
  philox_uniform(philox_key(11, "parity.tokens"), 0, int64_t(r.size()), r.data());
  std::vector<int32_t> rows(r.size()), in(size_t(B * T)), tg(size_t(B * T));
  for (size_t i = 0; i < r.size(); ++i) rows[i] = int32_t(r[i] * V);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in[b * T + t] = rows[b * (T + 1) + t];
      tg[b * T + t] = rows[b * (T + 1) + t + 1];
    }
  std::ofstream(dir / "config.json") << config.to_json();
  std::vector<NamedTensor> w;
  for (ParamUnit* u : model.units())
    for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
  write_safetensors((dir / "model.safetensors").string(), w);
  {
    std::ofstream tok(dir / "tokens.bin", std::ios::binary);
    tok.write(reinterpret_cast<const char*>(rows.data()), std::streamsize(rows.size() * 4));
    std::ofstream(dir / "tokens.json") << "{\"batch\": " << B << ", \"seq_len\": " << T << "}";
  }
  model.zero_grad();
  const double loss =
      model.forward_backward(in.data(), tg.data(), B, T, 1.0f / float(B * T)) / double(B * T);

  const std::string cmd = "/usr/bin/python3 " + source_dir() + "/tests/parity/torch_gla.py --dir " +
                          dir.string() + " > " + (dir / "torch.log").string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir / "torch.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << "the PyTorch reference failed:\n" << cmd << "\n" << text;

  SafetensorsFile ref((dir / "torch_out.safetensors").string());
  float torch_loss = 0;
  ref.read_f32("loss", {1}, &torch_loss);
  EXPECT_LE(std::abs(loss - torch_loss) / std::abs(torch_loss), 1e-5)
      << "loom " << loss << " torch " << torch_loss;
  int n = 0;
  for (ParamUnit* u : model.units())
    for (auto& p : u->params()) {
      std::vector<float> want(size_t(p.grad.numel()));
      ref.read_f32(p.spec.name, p.grad.shape(), want.data());
      const float* got = p.grad.data<float>();
      EXPECT_LE(test::rel_l2(std::vector<float>(got, got + want.size()), want), 1e-4)
          << p.spec.name;
      ++n;
    }
  EXPECT_EQ(n, int(config.params().size()));  // every parameter of fla's table compared

  // bf16 GEMMs (fp32 accumulation) on the same weights: the loss within bf16's rounding.
  GlaModel bf(config, DType::bf16);
  auto fu = model.units(), bu = bf.units();
  for (size_t i = 0; i < fu.size(); ++i) {
    std::copy_n(fu[i]->flat().data<float>(), fu[i]->numel(), bu[i]->flat().data<float>());
    bu[i]->refresh_bf16();
  }
  bf.zero_grad();
  const double bf_loss =
      bf.forward_backward(in.data(), tg.data(), B, T, 1.0f / float(B * T)) / double(B * T);
  EXPECT_LE(std::abs(bf_loss - torch_loss) / std::abs(torch_loss), 2e-2) << "bf16 " << bf_loss;
  EXPECT_NE(bf_loss, loss);  // the bf16 path ran
  fs::remove_all(dir);
}

}  // namespace

// T = 67: not a multiple of the chunk (64) nor of the sub-chunk (16).
TEST(GlaTorchParity, UntiedGqa) {
  check_parity(small_config(false), 2, 67, "untied");
}

TEST(GlaTorchParity, TiedNoOutputGateClamped) {
  check_parity(small_config(true), 2, 45, "tied");
}

TEST(GlaTorchParity, ShortConvolution) {
  check_parity(small_config(false, true), 2, 37, "conv");
}
