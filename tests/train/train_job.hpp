#pragma once
// A temporary directory with a tiny model config and a small dataset for trainer tests: a random
// sequence of period 37 (learnable from a 16-token context) in train shards of the given sizes
// and one val shard, and the job config around them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/token_shard.hpp"
#include "data/tokenizer.hpp"
#include "train/optimizer.hpp"
#include "train/trainer.hpp"

namespace loom::test {

constexpr int64_t kJobVocab = 48;

struct TrainJobSpec {
  std::string prefix;      // of the directory's name
  std::string model_json;  // the model config.json
  std::vector<size_t> train_shards;
  std::string decay_type;  // [lr_scheduler]
};

class TrainJob {
 public:
  explicit TrainJob(const TrainJobSpec& spec) : decay_type_(spec.decay_type) {
    namespace fs = std::filesystem;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (spec.prefix + "_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "data");
    std::ofstream(dir_ / "model.json") << spec.model_json;
    std::mt19937 rng(5);
    std::vector<int32_t> period(37);
    for (auto& t : period) t = int32_t(rng() % kJobVocab);
    auto stream = [&](size_t n, size_t first) {
      std::vector<int32_t> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = period[(first + i) % period.size()];
      return v;
    };
    size_t first = 0;
    for (size_t k = 0; k < spec.train_shards.size(); ++k) {
      char name[32];
      std::snprintf(name, sizeof name, "train-%05zu.bin", k);
      write_shard(data(name), stream(spec.train_shards[k], first), kJobVocab);
      first += spec.train_shards[k];
    }
    write_shard(data("val-00000.bin"), stream(400, 11), kJobVocab);
    // A real one: the trainer parses the tokenizer that checkpoints carry before it trains.
    Tokenizer::train("a tokenizer for the test, for the test", 260).save(data("tokenizer.json"));
    out_ = std::fopen("/dev/null", "w");
  }
  ~TrainJob() {
    std::fclose(out_);
    std::filesystem::remove_all(dir_);
  }
  TrainJob(const TrainJob&) = delete;
  TrainJob& operator=(const TrainJob&) = delete;

  std::string path(const std::string& s) const { return (dir_ / s).string(); }
  std::string data(const std::string& s) const { return (dir_ / "data" / s).string(); }

  JobConfig config(const std::vector<std::string>& overrides = {}) const {
    const std::string toml = str_cat(R"([model]
config = ")",
                                     path("model.json"), R"("
seed = 3
[data]
path = ")",
                                     path("data"), R"("
[training]
steps = 6
local_batch_size = 2
seq_len = 16
grad_accum_steps = 1
max_norm = 1.0
[optimizer]
lr = 1e-2
weight_decay = 0.1
[lr_scheduler]
warmup_steps = 2
decay_type = ")",
                                     decay_type_, R"("
[metrics]
log_every = 1
tensorboard = ""
)");
    return parse_job_config(toml, path("job.toml"), overrides);
  }

  TrainerOptions options(const std::atomic<bool>* stop = nullptr) const {
    TrainerOptions o;
    o.out = out_;
    o.gemm_peak_seconds = 0;  // MFU needs a 0.2 s measurement; not what these tests check
    o.stop = stop;
    return o;
  }

 private:
  std::filesystem::path dir_;
  std::string decay_type_;
  FILE* out_ = nullptr;
};

// Weights and both AdamW moments, as raw bits.
inline std::vector<uint32_t> state_bits(Trainer& t) {
  std::vector<uint32_t> out;
  auto add = [&](const Tensor& x) {
    const size_t at = out.size();
    out.resize(at + size_t(x.numel()));
    std::memcpy(out.data() + at, x.raw(), size_t(x.numel()) * 4);
  };
  for (ParamUnit* u : t.model().units()) add(u->flat());
  for (auto& m : t.optimizer().exp_avg()) add(m);
  for (auto& v : t.optimizer().exp_avg_sq()) add(v);
  return out;
}

}  // namespace loom::test
