// `loom convert`: Hugging Face -> loom -> Hugging Face is bit-identical in f32 (file for file,
// with the same split), bfloat16 export rounds each weight, an imported checkpoint loads with the
// weights and fresh AdamW state, and bad input is an error naming the directory, file and tensor,
// with nothing written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/philox.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "train/checkpoint.hpp"
#include "train/optimizer.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

struct Result {
  int rc;
  std::string out;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

LlamaConfig config() {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 96;
  return c;
}

class ConvertCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* b = std::getenv("LOOM_BIN");
    if (!b) GTEST_SKIP() << "LOOM_BIN is not set (run through ctest)";
    bin_ = b;
    // The pid too: other checkouts on the machine run the same tests at the same time.
    dir_ = fs::temp_directory_path() /
           ("loom_convert_test_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // A Hugging Face directory split into several files, with a tokenizer file to carry along.
  // `skip`: a tensor left out; `wrong`: a tensor written with one row less.
  void write_hf(const fs::path& d, const std::string& skip = "", const std::string& wrong = "") {
    LlamaModel m(config(), DType::f32);
    m.init_weights(5);
    std::vector<NamedTensor> w;
    for (ParamUnit* u : m.units())
      for (auto& p : u->params()) {
        if (p.spec.name == skip) continue;
        Tensor t = p.value;
        if (p.spec.name == wrong) t = t.narrow(0, 0, t.shape()[0] - 1);
        w.push_back({p.spec.name, t});
      }
    write_safetensors_dir(d.string(), w, 20000);
    std::ofstream(d / "config.json") << config().to_json();
    std::ofstream(d / "tokenizer_config.json") << "{\"model_max_length\": 64}";
  }

  Result convert(const std::string& args) {
    const fs::path out = dir_ / "out.txt";
    const std::string cmd =
        "OMP_NUM_THREADS=1 " + bin_ + " convert " + args + " > " + out.string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    return {rc, slurp(out)};
  }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }

  std::string bin_;
  fs::path dir_;
};

std::vector<std::string> files_of(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_F(ConvertCommand, RoundTripIsBitIdentical) {
  write_hf(dir_ / "hf");
  ASSERT_GT(files_of(dir_ / "hf").size(), 4u);  // several model-0000i-of-0000n files
  Result r = convert(p("hf") + " " + p("ck/step-00000000"));
  ASSERT_EQ(r.rc, 0) << r.out;
  r = convert(p("ck") + " " + p("hf2") + " --max-shard-bytes 20000");
  ASSERT_EQ(r.rc, 0) << r.out;
  // The same files, byte for byte (config.json: the same model).
  std::vector<std::string> want = files_of(dir_ / "hf");
  ASSERT_EQ(files_of(dir_ / "hf2"), want);
  for (const std::string& f : want) {
    if (f == "config.json") continue;
    EXPECT_TRUE(slurp(dir_ / "hf" / f) == slurp(dir_ / "hf2" / f)) << f;
  }
  EXPECT_EQ(LlamaConfig::from_file(p("hf2/config.json")).to_json(), config().to_json());

  // bfloat16: each weight rounded.
  r = convert(p("ck/step-00000000") + " " + p("bf") + " --dtype bfloat16");
  ASSERT_EQ(r.rc, 0) << r.out;
  const SafetensorsDir hf(p("hf")), bf(p("bf"));
  EXPECT_TRUE(fs::exists(dir_ / "bf/model.safetensors"));
  for (const std::string& n : hf.names()) {
    ASSERT_EQ(bf.file_of(n).entry(n).dtype, "BF16") << n;
    const Shape s = hf.shape(n);
    std::vector<float> a(size_t(shape_numel(s))), b(a.size());
    hf.read_f32(n, s, a.data());
    bf.read_f32(n, s, b.data());
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(b[i], bf16_to_float(float_to_bf16(a[i]))) << n << " " << i;
  }

  // The imported checkpoint loads: the weights, AdamW afresh at step 0.
  LlamaModel m(config(), DType::f32), ref(config(), DType::f32);
  ref.init_weights(5);
  m.init_weights(9);
  AdamW opt(m.units(), AdamWConfig{});
  for (Tensor& t : opt.exp_avg()) std::fill_n(t.data<float>(), t.numel(), 1.0f);
  const TrainState st = load_checkpoint(p("ck/step-00000000"), m, opt);
  EXPECT_EQ(st.step, 0);
  EXPECT_EQ(opt.steps_taken(), 0);
  for (size_t i = 0; i < m.units().size(); ++i) {
    Tensor& a = m.units()[i]->flat();
    Tensor& b = ref.units()[i]->flat();
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << i;
    for (int64_t k = 0; k < opt.exp_avg()[i].numel(); ++k)
      ASSERT_EQ(opt.exp_avg()[i].data<float>()[k], 0.0f);
  }
}

TEST_F(ConvertCommand, BadInputIsNamedAndNothingIsWritten) {
  // A missing tensor: the directory and the tensor.
  write_hf(dir_ / "missing", "model.layers.1.mlp.up_proj.weight");
  Result r = convert(p("missing") + " " + p("out1"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("missing: tensor 'model.layers.1.mlp.up_proj.weight'"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "out1"));
  // A mis-shaped tensor: the tensor, its file, both shapes.
  write_hf(dir_ / "shape", "", "model.layers.0.self_attn.k_proj.weight");
  r = convert(p("shape") + " " + p("out2"));
  EXPECT_NE(r.rc, 0);
  for (const char* part :
       {"model.layers.0.self_attn.k_proj.weight", "model-0000", "[15, 32]", "[16, 32]"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "out2"));
  // An existing destination is never overwritten.
  write_hf(dir_ / "hf");
  fs::create_directories(dir_ / "taken");
  r = convert(p("hf") + " " + p("taken"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("exists"), std::string::npos) << r.out;
  // A checkpoint missing a rank's file: the index and the file.
  ASSERT_EQ(convert(p("hf") + " " + p("ck")).rc, 0);
  fs::remove(dir_ / "ck/rank-00000.safetensors");
  r = convert(p("ck") + " " + p("out3"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("rank-00000.safetensors"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "out3"));
  // Nothing half-written anywhere.
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

// A checkpoint that loom trained and saved, exported by `loom convert`, runs in the independent
// PyTorch reference (tests/parity/torch_llama.py, /usr/bin/python3 with Debian's python3-torch):
// the same loss and parameter gradients as loom on the same tokens. The export reads the
// checkpoint's rank file and index, not loom's in-memory weights, so a slice written or named
// wrongly shows here.
TEST_F(ConvertCommand, ExportRunsInThePyTorchReference) {
  const LlamaConfig c = config();
  LlamaModel m(c, DType::f32);
  m.init_weights(3);
  const int64_t B = 2, T = 19, V = c.vocab_size;
  std::vector<float> u(size_t(B * (T + 1)));
  philox_uniform(philox_key(11, "convert.tokens"), 0, int64_t(u.size()), u.data());
  std::vector<int32_t> rows(u.size()), in(size_t(B * T)), tg(size_t(B * T));
  for (size_t i = 0; i < u.size(); ++i) rows[i] = int32_t(u[i] * float(V));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in[size_t(b * T + t)] = rows[size_t(b * (T + 1) + t)];
      tg[size_t(b * T + t)] = rows[size_t(b * (T + 1) + t + 1)];
    }
  // Two AdamW steps, so the exported weights (norms included) are no longer their initial values.
  AdamW opt(m.units(), AdamWConfig{});
  for (int s = 0; s < 2; ++s) {
    m.zero_grad();
    m.forward_backward(in.data(), tg.data(), B, T, 1.0f / float(B * T));
    opt.step(1e-2f);
  }
  save_checkpoint(p("ck"), m, opt, TrainState{2, 2, 1e-2, 0, "", B * T});
  Result r = convert(p("ck") + " " + p("hf"));
  ASSERT_EQ(r.rc, 0) << r.out;
  ASSERT_TRUE(fs::exists(dir_ / "hf/model.safetensors")) << "one file, as torch_llama.py reads";
  {
    std::ofstream tok(dir_ / "hf/tokens.bin", std::ios::binary);
    tok.write(reinterpret_cast<const char*>(rows.data()), std::streamsize(rows.size() * 4));
    std::ofstream(dir_ / "hf/tokens.json") << "{\"batch\": " << B << ", \"seq_len\": " << T << "}";
  }
  m.zero_grad();
  const double loss =
      m.forward_backward(in.data(), tg.data(), B, T, 1.0f / float(B * T)) / double(B * T);

  const char* src = std::getenv("LOOM_SOURCE_DIR");
  const std::string cmd = "/usr/bin/python3 " + std::string(src ? src : ".") +
                          "/tests/parity/torch_llama.py --dir " + p("hf") +
                          " --dtype float32 --threads 1 > " + p("torch.log") + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << slurp(dir_ / "torch.log");
  SafetensorsFile ref(p("hf/torch_out.safetensors"));
  float torch_loss;
  ref.read_f32("loss", {1}, &torch_loss);
  EXPECT_LE(std::abs(loss - torch_loss) / std::abs(torch_loss), 1e-5)
      << "loom " << loss << " torch " << torch_loss;
  for (ParamUnit* u : m.units())
    for (auto& prm : u->params()) {
      std::vector<float> want(size_t(prm.grad.numel()));
      ref.read_f32(prm.spec.name, prm.grad.shape(), want.data());
      const float* got = prm.grad.data<float>();
      double num = 0, den = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
      }
      EXPECT_LE(std::sqrt(num / den), 1e-4) << prm.spec.name;
    }
}

// A loom checkpoint whose rank file changed after it was saved (one byte of a tensor flipped) is
// refused, naming the file and both checksums, with nothing written; --no-verify exports it as
// it is. A Hugging Face source records no checksums and converts as before.
TEST_F(ConvertCommand, CorruptCheckpointIsRefusedUnlessNoVerify) {
  write_hf(dir_ / "hf");
  ASSERT_EQ(convert(p("hf") + " " + p("ck/step-00000000")).rc, 0);
  const std::string rank0 = p("ck/step-00000000/rank-00000.safetensors");
  {
    std::fstream f(rank0, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(-4, std::ios::end);
    const char c = char(f.get());  // flipped: whatever it was, it changes
    f.seekp(-4, std::ios::end);
    f.put(char(~c));
  }
  Result r = convert(p("ck") + " " + p("out"));
  EXPECT_NE(r.rc, 0);
  for (const char* part :
       {"rank-00000.safetensors", "checksum mismatch", "expected xxh3-64:", "found xxh3-64:"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " in " << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "out"));
  // Given as the step directory itself: the same.
  r = convert(p("ck/step-00000000") + " " + p("out"));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("checksum mismatch"), std::string::npos) << r.out;
  r = convert(p("ck") + " " + p("out") + " --no-verify");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "out/model.safetensors"));
}
