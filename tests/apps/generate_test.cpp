// `loom generate` through the loom binary on a small random model written to disk the way the
// trainer and Hugging Face lay it out: same seed same text, checkpoint resolution, errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/read_file.hpp"
#include "data/tokenizer.hpp"
#include "model/gla.hpp"
#include "model/llama.hpp"
#include "model/moe.hpp"
#include "model/safetensors.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

struct Result {
  int rc;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class GenerateCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* b = std::getenv("LOOM_BIN");
    if (!b) GTEST_SKIP() << "LOOM_BIN is not set (run through ctest)";
    bin_ = b;
    dir_ = fs::temp_directory_path() /
           ("loom_generate_test_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // A model directory: config.json, model.safetensors and (optionally) tokenizer.json.
  void write_model(const fs::path& d, uint64_t seed, bool with_tokenizer = true) {
    LlamaConfig c;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.vocab_size = 320;
    c.max_position_embeddings = 96;
    LlamaModel m(c, DType::f32);
    m.init_weights(seed);
    write_weights(d, m, c.to_json());
    if (with_tokenizer) {
      const std::string text =
          "the quick brown fox jumps over the lazy dog. the dog sleeps; the fox runs away. "
          "a loom weaves threads into cloth, thread by thread, row by row.";
      // Repeated, so every merge up to 300 ids has pairs that occur many times.
      std::string corpus;
      for (int i = 0; i < 20; ++i) corpus += text;
      Tokenizer::train(corpus, 300).save((d / "tokenizer.json").string());
    }
  }

  // A Hugging Face directory's config.json and model.safetensors of `m`.
  static void write_weights(const fs::path& d, Model& m, const std::string& config_json) {
    fs::create_directories(d);
    std::ofstream(d / "config.json") << config_json;
    std::vector<NamedTensor> w;
    for (ParamUnit* u : m.units())
      for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
    write_safetensors((d / "model.safetensors").string(), w);
  }

  // A Hugging Face Qwen2-MoE directory (tests/parity/moe_qwen2_debug.json: q/k/v biases, a shared
  // expert, a dense first layer) with the tokenizer of `from`.
  void write_moe_model(const fs::path& d, const fs::path& from, uint64_t seed) {
    const char* src = std::getenv("LOOM_SOURCE_DIR");
    const std::string path = std::string(src ? src : ".") + "/tests/parity/moe_qwen2_debug.json";
    const MoeConfig c = MoeConfig::from_json(read_file(path), path);
    MoeModel m(c, DType::f32);
    m.init_weights(seed);
    write_weights(d, m, c.to_json());
    fs::copy_file(from / "tokenizer.json", d / "tokenizer.json");
  }

  // An fla-format GLA directory (GlaModel::save_hf) with the tokenizer of `from`.
  void write_gla_model(const fs::path& d, const fs::path& from, uint64_t seed) {
    GlaConfig c;
    c.hidden_size = 64;
    c.num_hidden_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 4;
    c.intermediate_size = 128;
    c.vocab_size = 320;
    c.use_short_conv = true;
    GlaModel m(c, DType::f32);
    m.init_weights(seed);
    m.save_hf(d.string());
    fs::copy_file(from / "tokenizer.json", d / "tokenizer.json");
  }

  // `loom convert FROM TO`'s exit status.
  int convert(const fs::path& from, const fs::path& to) {
    const std::string cmd = "OMP_NUM_THREADS=1 " + bin_ + " convert " + from.string() + " " +
                            to.string() + " > /dev/null";
    return std::system(cmd.c_str());
  }

  Result generate(const std::string& args) {
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    // One thread: the model is tiny, and idle OpenMP threads spinning on a shared machine
    // would make each run take seconds.
    const std::string cmd = "OMP_NUM_THREADS=1 " + bin_ + " generate " + args + " > " +
                            out.string() + " 2> " + err.string();
    const int rc = std::system(cmd.c_str());
    return {rc, slurp(out), slurp(err)};
  }

  // Generation from the model directories `a` and `b` with `args` (after --prompt 'the fox'): both
  // run, `a` prints the prompt and something after it, and both print the same text.
  void expect_same_text(const fs::path& a, const fs::path& b, const std::string& args) {
    const std::string rest = " --prompt 'the fox' " + args;
    const Result ra = generate("--checkpoint " + a.string() + rest);
    const Result rb = generate("--checkpoint " + b.string() + rest);
    ASSERT_EQ(ra.rc, 0) << ra.err;
    ASSERT_EQ(rb.rc, 0) << rb.err;
    EXPECT_EQ(ra.out.rfind("the fox", 0), 0u) << ra.out;
    EXPECT_GT(ra.out.size(), std::string("the fox\n").size()) << "nothing was generated";
    EXPECT_EQ(ra.out, rb.out) << args;
  }

  std::string bin_;
  fs::path dir_;
};

}  // namespace

TEST_F(GenerateCommand, FixedSeedGivesTheSameText) {
  write_model(dir_ / "m", 3);
  const std::string base = "--checkpoint " + (dir_ / "m").string() +
                           " --prompt 'the fox' --max-tokens 24 --temperature 1.0 --top-p 0.9";
  const Result a = generate(base + " --seed 5");
  ASSERT_EQ(a.rc, 0) << a.err;
  EXPECT_EQ(a.out.rfind("the fox", 0), 0u) << "the prompt is printed first: " << a.out;
  EXPECT_GT(a.out.size(), std::string("the fox\n").size()) << "nothing was generated";
  EXPECT_NE(a.err.find("tokens/s"), std::string::npos) << a.err;
  const Result b = generate(base + " --seed 5");
  ASSERT_EQ(b.rc, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  const Result c = generate(base + " --seed 6");
  ASSERT_EQ(c.rc, 0) << c.err;
  EXPECT_NE(a.out, c.out);
  // Temperature 0 is greedy: the seed does not matter.
  const std::string greedy = "--checkpoint " + (dir_ / "m").string() +
                             " --prompt 'the fox' --max-tokens 16 --temperature 0";
  const Result g1 = generate(greedy + " --seed 1"), g2 = generate(greedy + " --seed 2");
  ASSERT_EQ(g1.rc, 0) << g1.err;
  EXPECT_EQ(g1.out, g2.out);
  // --device cpu: the same text where the default (auto) ran on the CPU too.
  const Result on_cpu = generate(greedy + " --device cpu");
  ASSERT_EQ(on_cpu.rc, 0) << on_cpu.err;
  EXPECT_NE(on_cpu.err.find("on cpu"), std::string::npos) << on_cpu.err;
  if (g1.err.find("on cpu") != std::string::npos) {
    EXPECT_EQ(on_cpu.out, g1.out);
  }
}

TEST_F(GenerateCommand, PicksTheLatestCompleteCheckpoint) {
  const fs::path root = dir_ / "ckpt";
  write_model(root / "step-00000005", 1);
  write_model(root / "step-00000007", 2);
  fs::remove(root / "step-00000007" / "model.safetensors");  // incomplete
  fs::create_directories(root / "step-00000009.tmp");        // still being written
  std::ofstream(root / "step-00000009.tmp" / "config.json") << "{";
  const Result r = generate("--checkpoint " + root.string() + " --prompt 'a loom' --max-tokens 4");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("step-00000005"), std::string::npos) << r.err;
}

// A loom checkpoint (here converted from the Hugging Face directory) generates what the Hugging
// Face directory does.
TEST_F(GenerateCommand, ReadsLoomCheckpointsAndHuggingFaceDirectories) {
  write_model(dir_ / "m", 4);
  ASSERT_EQ(convert(dir_ / "m", dir_ / "ck/step-00000000"), 0);
  ASSERT_TRUE(fs::exists(dir_ / "ck/step-00000000/loom.index.json"));
  const std::string args = " --prompt 'the fox' --max-tokens 12 --temperature 0";
  const Result hf = generate("--checkpoint " + (dir_ / "m").string() + args);
  const Result ck = generate("--checkpoint " + (dir_ / "ck").string() + args);
  ASSERT_EQ(hf.rc, 0) << hf.err;
  ASSERT_EQ(ck.rc, 0) << ck.err;
  EXPECT_EQ(hf.out, ck.out);
  EXPECT_NE(ck.err.find("step-00000000"), std::string::npos) << ck.err;
}

// GLA generates with its recurrent state from an fla-format directory and from the loom
// checkpoint converted from it (the trainer's format), the same text; the prompt's length is not
// bounded by max_position_embeddings (GLA has no positions).
TEST_F(GenerateCommand, GlaFromFlaDirectoriesAndLoomCheckpoints) {
  write_model(dir_ / "llama", 1);
  write_gla_model(dir_ / "gla", dir_ / "llama", 5);
  ASSERT_EQ(convert(dir_ / "gla", dir_ / "ck/step-00000000"), 0);
  expect_same_text(dir_ / "gla", dir_ / "ck", "--max-tokens 12 --temperature 0");
  const Result longer = generate("--checkpoint " + (dir_ / "gla").string() +
                                 " --prompt 'the fox' --max-tokens 2100 --temperature 0");
  ASSERT_EQ(longer.rc, 0) << longer.err;
}

// A mixture of experts generates with its KV cache from a Hugging Face directory and from the
// loom checkpoint converted from it, the same text; its prompt is bounded by
// max_position_embeddings as Llama's; --device cuda is refused by name (no CUDA kernels of the MoE
// ops yet).
TEST_F(GenerateCommand, MoeFromHuggingFaceDirectoriesAndLoomCheckpoints) {
  write_model(dir_ / "llama", 1);
  write_moe_model(dir_ / "moe", dir_ / "llama", 6);
  ASSERT_EQ(convert(dir_ / "moe", dir_ / "ck/step-00000000"), 0);
  expect_same_text(dir_ / "moe", dir_ / "ck", "--max-tokens 12 --temperature 0");
  expect_same_text(dir_ / "moe", dir_ / "ck", "--max-tokens 12 --temperature 1 --top-p 1 --seed 4");
  const std::string m = "--checkpoint " + (dir_ / "moe").string() + " --prompt 'the fox'";
  Result r = generate(m + " --max-tokens 3000");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("max_position_embeddings"), std::string::npos) << r.err;
  r = generate(m + " --max-tokens 3 --device cuda");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("model_type \"qwen2_moe\" (a mixture of experts) generates on the CPU only"),
            std::string::npos)
      << r.err;
}

TEST_F(GenerateCommand, Errors) {
  write_model(dir_ / "m", 3);
  write_model(dir_ / "notok", 3, false);
  const std::string m = "--checkpoint " + (dir_ / "m").string();
  Result r = generate("--checkpoint " + (dir_ / "nope").string() + " --prompt x");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  r = generate("--checkpoint " + dir_.string() + " --prompt x");  // no model, no step-*
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("no model in"), std::string::npos) << r.err;
  r = generate(m + " --prompt ''");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("encodes to no tokens"), std::string::npos) << r.err;
  r = generate(m + " --prompt x --max-tokens 1000");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("max_position_embeddings"), std::string::npos) << r.err;
  r = generate("--checkpoint " + (dir_ / "notok").string() + " --prompt x");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("tokenizer"), std::string::npos) << r.err;
  r = generate(m + " --prompt x --max-tokens 3 --top-p 0");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("top-p"), std::string::npos) << r.err;
  r = generate(m);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--prompt"), std::string::npos) << r.err;
  r = generate(m + " --prompt x --device tpu");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--device: expected auto, cpu or cuda, got 'tpu'"), std::string::npos)
      << r.err;
  // An explicit --tokenizer is used even when the model directory has none.
  r = generate("--checkpoint " + (dir_ / "notok").string() + " --tokenizer " +
               (dir_ / "m" / "tokenizer.json").string() + " --prompt x --max-tokens 3");
  EXPECT_EQ(r.rc, 0) << r.err;
}

// A loom checkpoint whose files changed after it was saved is refused before any is read (the
// weights, or the tokenizer it carries), naming the file and both checksums; --no-verify reads it.
TEST_F(GenerateCommand, CorruptLoomCheckpointIsRefusedUnlessNoVerify) {
  write_model(dir_ / "m", 4);
  ASSERT_EQ(convert(dir_ / "m", dir_ / "ck/step-00000000"), 0);
  const fs::path rank0 = dir_ / "ck/step-00000000/rank-00000.safetensors";
  {
    std::fstream f(rank0, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(-4, std::ios::end);
    const char c = char(f.get());  // flipped: whatever it was, it changes
    f.seekp(-4, std::ios::end);
    f.put(char(~c));
  }
  const std::string args =
      "--checkpoint " + (dir_ / "ck").string() + " --prompt 'the fox' --max-tokens 4 --seed 1";
  const Result bad = generate(args);
  EXPECT_NE(bad.rc, 0);
  for (const std::string& part : {rank0.string(), std::string("checksum mismatch"),
                                  std::string("expected xxh3-64:"), std::string("found xxh3-64:")})
    EXPECT_NE(bad.err.find(part), std::string::npos) << part << " in " << bad.err;
  const Result unchecked = generate(args + " --no-verify");
  EXPECT_EQ(unchecked.rc, 0) << unchecked.err;
}
