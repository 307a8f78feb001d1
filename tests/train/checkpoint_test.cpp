#include "train/checkpoint.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "model/checksum.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "tests/temp_dir.hpp"
#include "tests/test_util.hpp"
#include "train/optimizer.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

using loom::test::TempDir;

using loom::test::expect_error;

LlamaConfig tiny(int64_t layers = 2, int64_t dim = 32) {
  LlamaConfig c;
  c.hidden_size = dim;
  c.intermediate_size = 48;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.vocab_size = 40;
  return c;
}

// A model and optimizer with non-trivial state: two AdamW steps on random tokens.
struct Trained {
  LlamaModel model;
  AdamW opt;
  Trained(const LlamaConfig& c, uint64_t seed, DType dt = DType::f32)
      : model(c, dt), opt(model.units(), AdamWConfig{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f}) {
    model.init_weights(seed);
  }
  void train(int steps, uint64_t seed) {
    const int64_t B = 2, T = 8;
    std::vector<float> u(size_t(B * T + 1));
    for (int s = 0; s < steps; ++s) {
      philox_uniform(philox_key(seed, "tokens"), s * int64_t(u.size()), int64_t(u.size()),
                     u.data());
      std::vector<int32_t> tok(u.size());
      for (size_t i = 0; i < u.size(); ++i)
        tok[i] = int32_t(u[i] * float(model.config().vocab_size));
      model.zero_grad();
      model.forward_backward(tok.data(), tok.data() + 1, B, T, 1.0f / float(B * T));
      clip_grad_norm(model.units(), 1.0);
      opt.step(1e-2f);
    }
  }
};

// Every float of the weights and both moments, as raw bits.
std::vector<uint32_t> state_bits(Trained& t) {
  std::vector<uint32_t> out;
  auto add = [&](const Tensor& x) {
    const size_t n = size_t(x.numel());
    const size_t at = out.size();
    out.resize(at + n);
    std::memcpy(out.data() + at, x.raw(), n * 4);
  };
  for (ParamUnit* u : t.model.units()) add(u->flat());
  for (auto& m : t.opt.exp_avg()) add(m);
  for (auto& v : t.opt.exp_avg_sq()) add(v);
  return out;
}

TrainState state_at(int64_t step) {
  TrainState s;
  s.step = step;
  s.data_step = step + 3;
  s.lr = 1.25e-3 * double(step);
  s.loss = 3.0 + 1.0 / double(step + 7);
  s.config_toml = "[training]\nsteps = 9\n";
  return s;
}

void truncate_file(const std::string& path, size_t keep) {
  const auto size = fs::file_size(path);
  ASSERT_GT(size, keep);
  fs::resize_file(path, keep);
}

// Flips the bits of one byte `from_end` bytes before the end of the file: in a rank file, a byte
// of the last tensor's data, which the loader reads without complaint.
void flip_byte(const std::string& path, size_t from_end = 4) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  ASSERT_TRUE(f.good()) << path;
  f.seekg(0, std::ios::end);
  const std::streamoff at = f.tellg() - std::streamoff(from_end);
  char c = 0;
  f.seekg(at);
  f.read(&c, 1);
  c = char(~c);
  f.seekp(at);
  f.write(&c, 1);
  ASSERT_TRUE(f.good()) << path;
}

// Replaces the first `from` in a text file by `to`.
void edit_text(const std::string& path, const std::string& from, const std::string& to) {
  std::ifstream in(path);
  std::string s((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const size_t at = s.find(from);
  ASSERT_NE(at, std::string::npos) << from << " in " << path;
  s.replace(at, from.size(), to);
  std::ofstream(path, std::ios::trunc) << s;
}

}  // namespace

TEST(Checkpoint, NameAndListing) {
  EXPECT_EQ(checkpoint_name(100), "step-00000100");
  EXPECT_EQ(checkpoint_name(123456789), "step-123456789");
  TempDir t;
  EXPECT_TRUE(list_checkpoints(t / "absent").empty());
  EXPECT_EQ(latest_checkpoint(t / "absent"), "");
  for (const char* d : {"step-00000002", "step-00000010", "step-00000009", "step-00000011.tmp",
                        "step-00000012.old", "step-x", "other"}) {
    fs::create_directories(t / d);
    std::ofstream(t / (std::string(d) + "/state.json")) << "{}";
  }
  std::ofstream(t / "step-00000013") << "a file, not a checkpoint";
  // Without state.json (written last) a step directory is not a complete checkpoint.
  fs::create_directories(t / "step-00000014");
  auto all = list_checkpoints(t / "");
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].first, 2);
  EXPECT_EQ(all[1].first, 9);
  EXPECT_EQ(all[2].first, 10);
  EXPECT_EQ(fs::path(latest_checkpoint(t / "")).filename(), "step-00000010");
}

TEST(Checkpoint, RoundTripIsBitExactAndAHuggingFaceDir) {
  TempDir t;
  const LlamaConfig c = tiny();
  Trained a(c, 1);
  a.train(2, 7);
  std::ofstream(t / "tokenizer.json") << "{\"model\": {\"type\": \"BPE\"}}";
  const TrainState st = state_at(2);
  const std::string dir = save_checkpoint(t / "ckpt", a.model, a.opt, st, t / "tokenizer.json");
  EXPECT_EQ(dir, t / "ckpt/step-00000002");
  for (const char* f :
       {"rank-00000.safetensors", "loom.index.json", "config.json", "state.json", "tokenizer.json"})
    EXPECT_TRUE(fs::is_regular_file(fs::path(dir) / f)) << f;
  EXPECT_FALSE(fs::exists(t / "ckpt/step-00000002.tmp"));

  // Read like a Hugging Face model directory: config.json gives the same shape, tensors by HF
  // names with their global shapes, f32.
  const LlamaConfig back = LlamaConfig::from_file(dir + "/config.json");
  EXPECT_EQ(back.to_json(), c.to_json());
  const SafetensorsDir hf(dir);
  EXPECT_TRUE(hf.sharded());
  EXPECT_TRUE(hf.has("model.embed_tokens.weight"));
  EXPECT_TRUE(hf.has("model.layers.1.mlp.down_proj.weight"));
  EXPECT_TRUE(hf.has("lm_head.weight"));
  EXPECT_EQ(hf.shape("model.embed_tokens.weight"), (Shape{40, 32}));
  const SafetensorsFile rank0(dir + "/rank-00000.safetensors");
  EXPECT_EQ(rank0.entry("model.norm.weight").dtype, "F32");
  // The moments are stored per parameter name, with the step count in the index.
  EXPECT_EQ(hf.metadata().at("step"), "2");
  EXPECT_EQ(hf.shape("model.layers.0.self_attn.q_proj.weight.exp_avg_sq"), (Shape{32, 32}));

  // Restores into a differently initialized model: every bit of weights and moments.
  Trained b(c, 99);
  ASSERT_NE(state_bits(a), state_bits(b));
  const TrainState got = load_checkpoint(dir, b.model, b.opt);
  EXPECT_EQ(state_bits(a), state_bits(b));
  EXPECT_EQ(b.opt.steps_taken(), 2);
  EXPECT_EQ(got.step, st.step);
  EXPECT_EQ(got.data_step, st.data_step);
  EXPECT_EQ(got.lr, st.lr);  // doubles round-trip exactly through state.json
  EXPECT_EQ(got.loss, st.loss);
  EXPECT_EQ(got.config_toml, st.config_toml);
  // The two continue identically (AdamW's bias correction uses the restored step count).
  a.train(1, 8);
  b.train(1, 8);
  EXPECT_EQ(state_bits(a), state_bits(b));

  // bf16 mixed precision: the mirror is refreshed from the restored master weights.
  Trained c1(c, 1, DType::bf16), c2(c, 2, DType::bf16);
  c1.train(1, 3);
  save_checkpoint(t / "bf", c1.model, c1.opt, state_at(1));
  load_checkpoint(t / "bf/step-00000001", c2.model, c2.opt);
  for (size_t i = 0; i < c1.model.units().size(); ++i) {
    ParamUnit* u1 = c1.model.units()[i];
    ParamUnit* u2 = c2.model.units()[i];
    EXPECT_EQ(std::memcmp(u1->flat_bf16().raw(), u2->flat_bf16().raw(), u1->flat_bf16().nbytes()),
              0);
  }
}

TEST(Checkpoint, LeftoverTmpIsIgnoredAndReplaced) {
  TempDir t;
  Trained a(tiny(), 1);
  a.train(1, 1);
  save_checkpoint(t / "ck", a.model, a.opt, state_at(1));
  // A save of step 2 that crashed half-way: a .tmp directory with a partial file.
  fs::create_directories(t / "ck/step-00000002.tmp");
  std::ofstream(t / "ck/step-00000002.tmp/rank-00000.safetensors") << "partial";
  EXPECT_EQ(fs::path(latest_checkpoint(t / "ck")).filename(), "step-00000001");
  Trained b(tiny(), 5);
  load_checkpoint(latest_checkpoint(t / "ck"), b.model, b.opt);
  EXPECT_EQ(state_bits(a), state_bits(b));
  // The next save of that step replaces the leftover.
  a.train(1, 2);
  save_checkpoint(t / "ck", a.model, a.opt, state_at(2));
  EXPECT_FALSE(fs::exists(t / "ck/step-00000002.tmp"));
  EXPECT_EQ(fs::path(latest_checkpoint(t / "ck")).filename(), "step-00000002");
  load_checkpoint(t / "ck/step-00000002", b.model, b.opt);
  EXPECT_EQ(state_bits(a), state_bits(b));
  // Saving a step that exists replaces it.
  a.opt.set_steps_taken(2);
  a.train(1, 3);
  a.opt.set_steps_taken(2);
  save_checkpoint(t / "ck", a.model, a.opt, state_at(2));
  load_checkpoint(t / "ck/step-00000002", b.model, b.opt);
  EXPECT_EQ(state_bits(a), state_bits(b));
  EXPECT_FALSE(fs::exists(t / "ck/step-00000002.old"));
}

// What interrupted saves and prunes leave behind is tidied (and said), and a half-deleted
// checkpoint is never taken for the latest one.
TEST(Checkpoint, CleansWhatInterruptedSavesAndPrunesLeave) {
  TempDir t;
  Trained a(tiny(1), 1);
  for (int64_t s = 1; s <= 3; ++s) {
    a.train(1, uint64_t(s));
    save_checkpoint(t / "ck", a.model, a.opt, state_at(s));
  }
  // A prune of the old code cut short: step 4's directory lost its state.json and some files.
  fs::create_directories(t / "ck/step-00000004");
  std::ofstream(t / "ck/step-00000004/rank-00000.safetensors") << "half deleted";
  EXPECT_EQ(fs::path(latest_checkpoint(t / "ck")).filename(), "step-00000003");
  // A save cut short, a prune cut short, and a replaced step whose new copy never took its name.
  fs::create_directories(t / "ck/step-00000005.tmp");
  fs::create_directories(t / "ck/step-00000001.deleting");
  fs::rename(t / "ck/step-00000002", t / "ck/step-00000002.old");
  fs::create_directories(t / "ck/step-00000003.old");
  const std::vector<std::string> done = clean_checkpoint_dir(t / "ck");
  ASSERT_EQ(done.size(), 5u);
  std::string all;
  for (const auto& d : done) all += d + "\n";
  for (const char* want : {"step-00000004 (no state.json", "step-00000005.tmp (a save",
                           "step-00000001.deleting (a prune", "restored", "step-00000003.old"})
    EXPECT_NE(all.find(want), std::string::npos) << want << " in\n" << all;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(t / "ck")) left.push_back(e.path().filename());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-00000001", "step-00000002", "step-00000003"}));
  Trained b(tiny(1), 5);
  load_checkpoint(t / "ck/step-00000002", b.model, b.opt);
  EXPECT_TRUE(clean_checkpoint_dir(t / "ck").empty());
  // A prune renames before deleting, so it never leaves a step-N without state.json.
  prune_checkpoints(t / "ck", 1);
  EXPECT_EQ(list_checkpoints(t / "ck").size(), 1u);
  EXPECT_TRUE(clean_checkpoint_dir(t / "ck").empty());
}

TEST(Checkpoint, KeepsTheLastK) {
  TempDir t;
  Trained a(tiny(1), 1);
  for (int64_t s = 1; s <= 5; ++s) {
    a.train(1, uint64_t(s));
    save_checkpoint(t / "ck", a.model, a.opt, state_at(s));
    prune_checkpoints(t / "ck", 2);
  }
  auto all = list_checkpoints(t / "ck");
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 4);
  EXPECT_EQ(all[1].first, 5);
  prune_checkpoints(t / "ck", 0);  // 0 keeps all
  EXPECT_EQ(list_checkpoints(t / "ck").size(), 2u);
  prune_checkpoints(t / "ck", 1);
  EXPECT_EQ(list_checkpoints(t / "ck").size(), 1u);
}

TEST(Checkpoint, CorruptOrTruncatedFilesAreNamed) {
  TempDir t;
  Trained a(tiny(), 1);
  a.train(1, 1);
  auto fresh = [&](const std::string& name) {
    return save_checkpoint(t / name, a.model, a.opt, state_at(1));
  };
  Trained b(tiny(), 2);

  const std::string rank0 = "/rank-00000.safetensors";
  std::string d = fresh("trunc_model");
  truncate_file(d + rank0, fs::file_size(d + rank0) / 2);
  expect_error([&] { load_checkpoint(d, b.model, b.opt); }, {d + rank0});

  d = fresh("trunc_head");
  truncate_file(d + rank0, 100);
  expect_error([&] { load_checkpoint(d, b.model, b.opt); }, {d + rank0});

  d = fresh("bad_state");
  std::ofstream(d + "/state.json") << "{\"format\": \"loom-checkpoint\", \"step\": ";
  expect_error([&] { load_checkpoint(d, b.model, b.opt); }, {d + "/state.json"});

  // A number that is not an int64 (a float, or past its range; found by fuzz_checkpoint_state)
  // names the field, where nlohmann's conversion would be undefined.
  const std::string bad_steps[] = {"1.5", "8.8e64", "18446744073709551615", "\"7\""};
  for (size_t i = 0; i < std::size(bad_steps); ++i) {
    const std::string& bad = bad_steps[i];
    d = fresh("bad_step_" + std::to_string(i));
    std::ifstream f(d + "/state.json");
    std::string s((std::istreambuf_iterator<char>(f)), {});
    s.replace(s.find("\"data_step\": "), 13, "\"data_step\": " + bad + ", \"x\": ");
    std::ofstream(d + "/state.json") << s;
    expect_error([&] { load_checkpoint(d, b.model, b.opt); }, {d + "/state.json", "data_step"});
  }

  d = fresh("no_state");
  fs::remove(d + "/state.json");
  expect_error([&] { load_checkpoint(d, b.model, b.opt); }, {d + "/state.json"});

  d = fresh("no_rank_file");
  fs::remove(d + rank0);
  expect_error([&] { load_checkpoint(d, b.model, b.opt); },
               {d, "loom.index.json", "rank-00000.safetensors", "missing"});

  d = fresh("no_index");
  fs::remove(d + "/loom.index.json");
  expect_error([&] { load_checkpoint(d, b.model, b.opt); }, {d, "loom.index.json"});

  d = fresh("step_mismatch");
  {
    std::ifstream f(d + "/state.json");
    std::string s((std::istreambuf_iterator<char>(f)), {});
    s.replace(s.find("\"step\": 1"), 9, "\"step\": 7");
    std::ofstream(d + "/state.json") << s;
  }
  // state.json's own checksum finds the edit first; unverified, the index's step does.
  expect_error([&] { load_checkpoint(d, b.model, b.opt); },
               {d + "/state.json", "checksum mismatch"});
  expect_error([&] { load_checkpoint(d, b.model, b.opt, {}, false); },
               {"loom.index.json", "step 1", "step 7"});
}

TEST(Checkpoint, AnotherModelShapeIsNamed) {
  TempDir t;
  Trained a(tiny(2, 32), 1);
  const std::string d = save_checkpoint(t / "ck", a.model, a.opt, state_at(0));
  // Wider: the first tensor read names its name and both shapes.
  Trained wide(tiny(2, 64), 1);
  expect_error([&] { load_checkpoint(d, wide.model, wide.opt); },
               {"model.embed_tokens.weight", "[40, 64]", "[40, 32]"});
  // Shallower: the checkpoint has a layer the model lacks.
  Trained shallow(tiny(1, 32), 1);
  expect_error([&] { load_checkpoint(d, shallow.model, shallow.opt); },
               {"model.layers.1.", "not a parameter"});
  // Deeper: the model has a layer the checkpoint lacks.
  Trained deep(tiny(3, 32), 1);
  expect_error([&] { load_checkpoint(d, deep.model, deep.opt); }, {"model.layers.2."});
}

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

// An async save writes from the live shards and before_modify copies only what it has not
// written yet, so the optimizer steps after it do not reach the file: byte for byte the
// synchronous save's. The writer is held before piece `held` (pieces of 256 bytes: 0 is before
// anything, 5 the middle of the first tensor) while the model trains three more steps. The
// anti-test: with the copy skipped the writer reads the changed shards, and the files differ.
TEST(Checkpoint, AsyncSaveIsTheSyncSaveWhileTrainingGoesOn) {
  TempDir dir;
  const TrainState st = state_at(2);
  std::string ref;
  {
    Trained t(tiny(), 7);
    t.train(2, 1);
    ref = file_bytes(save_checkpoint(dir / "sync", t.model, t.opt, st) + "/rank-00000.safetensors");
  }
  struct Reset {
    ~Reset() { async_save_testing() = {}; }
  } reset;
  AsyncSaveTesting& hooks = async_save_testing();
  hooks.piece_bytes = 256;
  for (const int64_t held : {int64_t(0), int64_t(5)})
    for (const bool skip : {false, true}) {
      SCOPED_TRACE(str_cat("held before piece ", held, skip ? ", copy skipped" : ""));
      Trained t(tiny(), 7);
      t.train(2, 1);
      int64_t data_bytes = 0;
      for (ParamUnit* u : t.model.units()) data_bytes += 3 * u->numel() * 4;
      std::mutex mu;
      std::condition_variable cv;
      bool reached = false, go = false;
      hooks.skip_copy = skip;
      hooks.before_piece = [&](int64_t n) {
        std::unique_lock lock(mu);
        if (n != held) return;
        reached = true;
        cv.notify_all();
        cv.wait(lock, [&] { return go; });
      };
      const std::string name = str_cat("async", held, skip ? "_skip" : "");
      auto pending = save_checkpoint_async(dir / name, t.model, t.opt, st);
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return reached; });
      }
      const size_t copied = pending->before_modify();
      EXPECT_EQ(copied, skip ? 0 : size_t(data_bytes - held * 256));
      EXPECT_EQ(pending->before_modify(), 0u) << "a second call copies nothing";
      t.train(3, 2);
      {
        std::lock_guard lock(mu);
        go = true;
      }
      cv.notify_all();
      const std::string path = pending->wait();
      const std::string got = file_bytes(path + "/rank-00000.safetensors");
      ASSERT_EQ(got.size(), ref.size());
      if (skip)
        EXPECT_NE(got, ref) << "the anti-test: the writer read the changed shards";
      else
        EXPECT_TRUE(got == ref) << "the async file differs from the synchronous save's";
      Trained back(tiny(), 99);
      // The checksum hashed while writing, whatever the writer read from, is the file's.
      const CheckpointCheck check = check_checkpoint(path);
      EXPECT_EQ(check.error, "");
      EXPECT_TRUE(check.checksums);
      if (!skip) {
        load_checkpoint(path, back.model, back.opt);
        Trained t2(tiny(), 7);
        t2.train(2, 1);
        EXPECT_EQ(state_bits(back), state_bits(t2));
      }
    }
}

// Once the writer has written everything, before_modify has nothing to copy.
TEST(Checkpoint, AsyncSaveCopiesNothingOnceWritten) {
  TempDir dir;
  Trained t(tiny(), 7);
  t.train(2, 1);
  auto pending = save_checkpoint_async(dir / "a", t.model, t.opt, state_at(2));
  const std::string path = pending->wait();
  EXPECT_EQ(pending->before_modify(), 0u);
  Trained back(tiny(), 99);
  load_checkpoint(path, back.model, back.opt);
  EXPECT_EQ(state_bits(back), state_bits(t));
}

// A byte flipped in a rank file's tensor data is caught at load, naming the file and both
// checksums (before checksums, such a checkpoint loaded silently with the changed weight).
TEST(Checkpoint, FlippedByteInARankFileIsCaughtAtLoad) {
  TempDir t;
  Trained a(tiny(), 1);
  a.train(1, 1);
  const std::string d = save_checkpoint(t / "ck", a.model, a.opt, state_at(1));
  const std::string rank0 = d + "/rank-00000.safetensors";
  flip_byte(rank0);
  Trained b(tiny(), 2);
  expect_error([&] { load_checkpoint(d, b.model, b.opt); },
               {rank0, "checksum mismatch", "expected xxh3-64:", "found xxh3-64:"});
}

// Every file of a checkpoint is covered: the rank files, config.json and tokenizer.json by the
// index, the index by state.json, state.json by itself. Each error names the file, the expected
// checksum (the recorded one) and the found one. verify = false reads a changed tensor unchecked.
TEST(Checkpoint, EveryFileIsCoveredAndVerifyFalseSkipsTheCheck) {
  TempDir t;
  Trained a(tiny(), 1);
  a.train(1, 1);
  std::ofstream(t / "tokenizer.json") << "{\"model\": {\"type\": \"BPE\"}}";
  const std::string ref =
      save_checkpoint(t / "ref", a.model, a.opt, state_at(1), t / "tokenizer.json");
  const CheckpointCheck ok = check_checkpoint(ref);
  EXPECT_EQ(ok.error, "");
  EXPECT_TRUE(ok.checksums);
  EXPECT_EQ(verify_checkpoint(ref), "");
  // The recorded checksums are those of the files' bytes.
  nlohmann::json index;
  std::ifstream(ref + "/loom.index.json") >> index;
  std::vector<std::string> covered;
  for (const auto& [file, sum] : index.at("checksums").items()) {
    covered.push_back(file);
    EXPECT_EQ(sum.get<std::string>(), checksum_text(checksum_file(ref + "/" + file))) << file;
  }
  EXPECT_EQ(covered,
            (std::vector<std::string>{"config.json", "rank-00000.safetensors", "tokenizer.json"}));
  nlohmann::json state;
  std::ifstream(ref + "/state.json") >> state;
  EXPECT_EQ(state.at("index_checksum"), checksum_text(checksum_file(ref + "/loom.index.json")));

  int n = 0;
  auto copy = [&] {
    const std::string d = t / str_cat("c", n++, "/step-00000001");
    fs::create_directories(fs::path(d).parent_path());
    fs::copy(ref, d);
    return d;
  };
  // Edits that keep each file well-formed, so that only its checksum can tell.
  const struct {
    const char* file;
    std::function<void(const std::string&)> edit;
    const char* recorded_in;
  } cases[] = {
      {"rank-00000.safetensors", [](const std::string& p) { flip_byte(p); }, "loom.index.json"},
      {"config.json", [](const std::string& p) { edit_text(p, "1e-05", "2e-05"); },
       "loom.index.json"},
      {"tokenizer.json", [](const std::string& p) { edit_text(p, "BPE", "BPF"); },
       "loom.index.json"},
      {"loom.index.json", [](const std::string& p) { edit_text(p, "adamw", "adamx"); },
       "state.json"},
      {"state.json", [](const std::string& p) { edit_text(p, "\"loss\": 3.", "\"loss\": 4."); },
       "recorded in it"},
  };
  Trained b(tiny(), 2);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    const std::string d = copy();
    const std::string path = d + "/" + c.file;
    std::string expected;
    if (std::string(c.recorded_in) == "loom.index.json")
      expected = index.at("checksums").at(c.file).get<std::string>();
    else if (std::string(c.recorded_in) == "state.json")
      expected = state.at("index_checksum").get<std::string>();
    else
      expected = state.at("checksum").get<std::string>();
    c.edit(path);
    std::vector<std::string> want = {"checkpoint " + d + " is corrupt",
                                     path,
                                     "checksum mismatch",
                                     "expected " + expected,
                                     c.recorded_in,
                                     "found xxh3-64:"};
    if (std::string(c.file) != "state.json")
      want.push_back("found " + checksum_text(checksum_file(path)));
    expect_error([&] { load_checkpoint(d, b.model, b.opt); }, want);
    const CheckpointCheck bad = check_checkpoint(d);
    EXPECT_NE(bad.error.find(path), std::string::npos) << bad.error;
    EXPECT_TRUE(bad.checksums);
  }
  // Unverified, the flipped tensor byte loads: the weights are the saved ones but that one.
  const std::string d = copy();
  flip_byte(d + "/rank-00000.safetensors");
  load_checkpoint(d, b.model, b.opt, {}, false);
  const std::vector<uint32_t> want = state_bits(a), got = state_bits(b);
  ASSERT_EQ(got.size(), want.size());
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  EXPECT_EQ(differ, 1u);
  // A missing file the index records: named.
  const std::string m = copy();
  fs::remove(m + "/tokenizer.json");
  expect_error([&] { load_checkpoint(m, b.model, b.opt); }, {m + "/tokenizer.json", "cannot open"});
}

// A checkpoint saved before checksums (none in state.json or the index) still loads, with a
// note that it was not verified; one record of the three removed is an error, not an old
// checkpoint (a flipped byte must not turn verification off).
TEST(Checkpoint, CheckpointsWithoutChecksumsStillLoad) {
  TempDir t;
  Trained a(tiny(), 1);
  a.train(1, 1);
  const std::string d = save_checkpoint(t / "ck", a.model, a.opt, state_at(1));
  auto drop = [](const std::string& path, const std::vector<std::string>& keys) {
    nlohmann::ordered_json j;
    std::ifstream(path) >> j;
    for (const auto& k : keys) j.erase(k);
    std::ofstream(path, std::ios::trunc) << j.dump(2) << "\n";
  };
  const std::string old = t / "old/step-00000001";
  fs::create_directories(fs::path(old).parent_path());
  fs::copy(d, old);
  drop(old + "/state.json", {"checksum", "index_checksum"});
  drop(old + "/loom.index.json", {"checksums"});
  const CheckpointCheck c = check_checkpoint(old);
  EXPECT_EQ(c.error, "");
  EXPECT_FALSE(c.checksums);
  const std::string note = verify_checkpoint(old);
  EXPECT_NE(note.find(old), std::string::npos) << note;
  EXPECT_NE(note.find("records no checksums"), std::string::npos) << note;
  const ResumeChoice r = choose_resume_checkpoint(t / "old", true, false);
  EXPECT_EQ(r.dir, old);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_EQ(r.notes[0], note);
  Trained b(tiny(), 2);
  load_checkpoint(old, b.model, b.opt);
  EXPECT_EQ(state_bits(a), state_bits(b));

  const std::string half = t / "half/step-00000001";
  fs::create_directories(fs::path(half).parent_path());
  fs::copy(d, half);
  drop(half + "/state.json", {"checksum"});
  expect_error([&] { load_checkpoint(half, b.model, b.opt); },
               {half + "/state.json", "no checksum of its own"});
}

// A resume's choice: the latest checkpoint, verified. A corrupt one (a checksum mismatch, a
// missing file, an index that does not parse) is an error naming the previous complete
// checkpoint, or with fallback skipped with a note naming it and why, down to the first that
// verifies; an error when none does. verify = false takes the latest unchecked.
TEST(Checkpoint, ResumeChoiceFallsBackOnlyWhenAsked) {
  TempDir t;
  Trained a(tiny(1), 1);
  for (int64_t s = 1; s <= 4; ++s) {
    a.train(1, uint64_t(s));
    save_checkpoint(t / "ck", a.model, a.opt, state_at(s));
  }
  const std::string root = t / "ck";
  auto step = [&](int s) { return root + "/" + checkpoint_name(s); };
  EXPECT_EQ(choose_resume_checkpoint(root, true, false).dir, step(4));
  EXPECT_TRUE(choose_resume_checkpoint(root, true, false).notes.empty());
  flip_byte(step(4) + "/rank-00000.safetensors");
  fs::remove(step(3) + "/rank-00000.safetensors");
  edit_text(step(2) + "/loom.index.json", "{", "[");

  expect_error([&] { choose_resume_checkpoint(root, true, false); },
               {"checkpoint " + step(4) + " is corrupt", step(4) + "/rank-00000.safetensors",
                "checksum mismatch", "the previous complete checkpoint is " + step(3),
                "--checkpoint.fallback=true"});
  const ResumeChoice r = choose_resume_checkpoint(root, true, true);
  EXPECT_EQ(r.dir, step(1));
  ASSERT_EQ(r.notes.size(), 3u);
  const std::pair<int, const char*> why[] = {
      {4, "checksum mismatch"}, {3, "does not exist"}, {2, "not valid JSON"}};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NE(r.notes[i].find("skipping checkpoint " + step(why[i].first)), std::string::npos)
        << r.notes[i];
    EXPECT_NE(r.notes[i].find(why[i].second), std::string::npos) << r.notes[i];
  }
  EXPECT_EQ(choose_resume_checkpoint(root, false, false).dir, step(4));
  // The first one corrupt too: nothing to resume from.
  edit_text(step(1) + "/config.json", "\"hidden_size\": 32", "\"hidden_size\": 33");
  expect_error([&] { choose_resume_checkpoint(root, true, true); },
               {"every checkpoint in '" + root + "' is corrupt", step(1) + "/config.json",
                step(4) + "/rank-00000.safetensors"});
  expect_error([&] { load_checkpoint(step(1), a.model, a.opt); },
               {step(1) + "/config.json", "no earlier complete checkpoint"});
  EXPECT_TRUE(choose_resume_checkpoint(t / "absent", true, true).dir.empty());
}
