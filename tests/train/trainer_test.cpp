#include "train/trainer.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.hpp"
#include "data/token_shard.hpp"
#include "model/llama.hpp"
#include "tests/test_util.hpp"
#include "tests/train/train_job.hpp"
#include "train/checkpoint.hpp"
#include "train/metrics.hpp"
#include "train/optimizer.hpp"
#include "train/run_claim.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

using loom::test::expect_error;

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

constexpr int64_t kVocab = test::kJobVocab;

// A tiny Llama and the period-37 sequence in two train shards (tests/train/train_job.hpp).
class Job : public test::TrainJob {
 public:
  Job()
      : TrainJob({"loom_trainer",
                  R"({"hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
      "vocab_size": 48, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
      "tie_word_embeddings": false})",
                  {1500, 700},
                  "cosine"}) {}
};

using test::state_bits;

std::vector<float> weights(Trainer& t) {
  std::vector<float> out;
  for (ParamUnit* u : t.model().units()) {
    const float* p = u->flat().data<float>();
    out.insert(out.end(), p, p + u->numel());
  }
  return out;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(Trainer, LossFallsAndMetricsAreWritten) {
  Job job;
  Trainer t(job.config({"--training.steps=40", "--validation.interval=10", "--validation.steps=3",
                        "--metrics.jsonl=" + job.path("m/metrics.jsonl")}),
            job.options());
  const TrainResult r = t.run();
  ASSERT_EQ(r.steps.size(), 40u);
  EXPECT_FALSE(r.interrupted);
  EXPECT_EQ(t.step(), 40);
  // ln(48) = 3.87 at the start; the period-37 sequence is learnable from a 16-token context.
  EXPECT_NEAR(r.steps.front().loss, std::log(double(kVocab)), 0.3);
  EXPECT_LT(r.steps.back().loss, 1.5);
  ASSERT_EQ(r.val_losses.size(), 4u);
  EXPECT_EQ(r.val_losses.back().first, 40);
  EXPECT_LT(r.val_losses.back().second, r.val_losses.front().second);

  const auto lines = read_jsonl(job.path("m/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 44u);
  int steps = 0, vals = 0;
  for (const auto& j : lines) {
    if (j.contains("val_loss")) {
      ++vals;
      EXPECT_EQ(j["step"].get<int64_t>() % 10, 0);
      continue;
    }
    ++steps;
    for (const char* k :
         {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_allocated_bytes"})
      EXPECT_TRUE(j.contains(k)) << k << " in " << j.dump();
    const auto& rec = r.steps[size_t(j["step"].get<int64_t>() - 1)];
    EXPECT_EQ(j["loss"].get<double>(), rec.loss);  // shortest round-trip text: exact
    EXPECT_EQ(j["lr"].get<double>(), rec.lr);
    EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["peak_allocated_bytes"].get<size_t>(), 0u);
  }
  EXPECT_EQ(steps, 40);
  EXPECT_EQ(vals, 4);
  // validate() is a pure function of the weights and leaves no gradient behind.
  const double v1 = t.validate(), v2 = t.validate();
  EXPECT_EQ(v1, v2);
  EXPECT_EQ(v1, r.val_losses.back().second);
  for (ParamUnit* u : t.model().units())
    for (int64_t i = 0; i < u->numel(); ++i) ASSERT_EQ(u->grad_flat().data<float>()[i], 0.0f);
}

// A run of 2N steps and a run of N steps + resume + N steps: the same losses and the same final
// weights and moments, bit for bit. The schedule must not depend on where the first run stops,
// so decay_type = none here; the cosine case is the interrupt test below.
TEST(Trainer, ResumeIsBitIdentical) {
  Job job;
  const std::vector<std::string> common = {"--lr_scheduler.decay_type=none",
                                           "--training.grad_accum_steps=2",
                                           "--validation.interval=2", "--checkpoint.interval=2"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return job.config(extra);
  };
  Trainer a(with({"--training.steps=6", "--checkpoint.dir=" + job.path("a")}), job.options());
  const TrainResult ra = a.run();

  std::vector<StepRecord> rb;
  {
    Trainer b(with({"--training.steps=3", "--checkpoint.dir=" + job.path("b")}), job.options());
    auto r = b.run();
    rb = r.steps;
    EXPECT_EQ(fs::path(r.last_checkpoint).filename(), "step-00000003");
  }
  Trainer b(
      with({"--training.steps=6", "--checkpoint.dir=" + job.path("b"), "--checkpoint.resume=true"}),
      job.options());
  EXPECT_EQ(b.step(), 3);
  const TrainResult r2 = b.run();
  rb.insert(rb.end(), r2.steps.begin(), r2.steps.end());
  ASSERT_EQ(ra.steps.size(), 6u);
  ASSERT_EQ(rb.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(rb[i].step, ra.steps[i].step);
    EXPECT_EQ(rb[i].loss, ra.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(rb[i].grad_norm, ra.steps[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(rb[i].lr, ra.steps[i].lr) << "step " << i + 1;
  }
  EXPECT_EQ(state_bits(a), state_bits(b));
  const std::vector<std::pair<int64_t, double>> later(ra.val_losses.begin() + 1,
                                                      ra.val_losses.end());
  EXPECT_EQ(r2.val_losses, later);
  // The final checkpoints agree too, and carry the tokenizer of the data directory.
  EXPECT_EQ(read_text(job.path("a/step-00000006/rank-00000.safetensors")),
            read_text(job.path("b/step-00000006/rank-00000.safetensors")));
  EXPECT_EQ(read_text(job.path("b/step-00000006/tokenizer.json")),
            read_text(job.data("tokenizer.json")));
}

// A stop request (what SIGINT/SIGTERM set) finishes the current step and saves a checkpoint;
// resuming from it reproduces the uninterrupted run bit for bit (cosine schedule, bf16 GEMMs).
TEST(Trainer, InterruptSavesAndResumeIsBitIdentical) {
  Job job;
  auto cfg = [&](const std::string& dir, bool resume) {
    return job.config({"--training.steps=5", "--training.mixed_precision_param=bfloat16",
                       "--checkpoint.dir=" + job.path(dir),
                       std::string("--checkpoint.resume=") + (resume ? "true" : "false"),
                       "--metrics.jsonl=" + job.path(dir + ".jsonl")});
  };
  Trainer a(cfg("a", false), job.options());
  const TrainResult ra = a.run();

  std::atomic<bool> stop{true};  // already requested: the run stops after its first step
  {
    Trainer b(cfg("b", false), job.options(&stop));
    const TrainResult r = b.run();
    EXPECT_TRUE(r.interrupted);
    EXPECT_EQ(r.final_step, 1);
    ASSERT_EQ(r.steps.size(), 1u);
    EXPECT_EQ(fs::path(r.last_checkpoint).filename(), "step-00000001");
  }
  {
    Trainer b(cfg("b", true), job.options(&stop));  // resumes at 1, stops after 2
    EXPECT_EQ(b.run().final_step, 2);
  }
  // A step logged after the last checkpoint by a run that then died: the resumed run redoes it
  // and drops the stale line.
  std::ofstream(job.path("b.jsonl"), std::ios::app) << "{\"step\": 3, \"loss\": 99.0}\n";
  stop = false;
  Trainer b(cfg("b", true), job.options(&stop));
  const TrainResult rb = b.run();
  EXPECT_FALSE(rb.interrupted);
  EXPECT_EQ(rb.steps.front().step, 3);
  EXPECT_EQ(state_bits(a), state_bits(b));
  // The resumed runs append to the JSONL: the same five losses as the uninterrupted run.
  const auto la = read_jsonl(job.path("a.jsonl")), lb = read_jsonl(job.path("b.jsonl"));
  ASSERT_EQ(la.size(), 5u);
  ASSERT_EQ(lb.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(lb[i]["step"], la[i]["step"]);
    EXPECT_EQ(lb[i]["loss"].get<double>(), la[i]["loss"].get<double>());
    EXPECT_EQ(lb[i]["loss"].get<double>(), ra.steps[i].loss);
  }
  // Saved: 1 and 2 (interrupted), 5 (the end); keep = 3 (the default) keeps all three.
  const auto kept = list_checkpoints(job.path("b"));
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_EQ(kept[0].first, 1);
  EXPECT_EQ(kept[1].first, 2);
  EXPECT_EQ(kept[2].first, 5);
}

// The global batch is the same whatever the split into micro-batches: 1 x 4, 2 x 2 and 4 x 1
// give the same losses and weights up to fp32 summation order. The loss of the first step sees
// identical weights, so only the reduction order differs (~1e-7 relative). Later steps and the
// weights go through AdamW, whose update m / (sqrt(v) + eps) is ~sign(g) for small gradients;
// eps = 1e-3 (vs gradients of 1e-4..1e-2 here) keeps that map smooth, so rounding differences of
// the gradient stay rounding-sized in the weights instead of flipping an update's sign.
TEST(Trainer, GradientAccumulationIsEquivalent) {
  Job job;
  std::vector<std::vector<float>> w;
  std::vector<std::vector<StepRecord>> losses;
  for (const auto& [accum, batch] : {std::pair{1, 4}, {2, 2}, {4, 1}}) {
    Trainer t(job.config({"--training.steps=3", "--optimizer.eps=1e-3",
                          "--training.grad_accum_steps=" + std::to_string(accum),
                          "--training.local_batch_size=" + std::to_string(batch)}),
              job.options());
    losses.push_back(t.run().steps);
    w.push_back(weights(t));
  }
  for (size_t k = 1; k < 3; ++k) {
    for (size_t s = 0; s < 3; ++s)
      EXPECT_NEAR(losses[k][s].loss, losses[0][s].loss, 1e-6 * losses[0][s].loss)
          << "accumulation " << k << " step " << s + 1;
    EXPECT_NEAR(losses[k][0].grad_norm, losses[0][0].grad_norm, 1e-5 * losses[0][0].grad_norm);
    EXPECT_LT(rel_l2(w[k], w[0]), 1e-6) << "accumulation " << k;
  }
  // A different batch (the window of samples moves) is not equivalent: the check can fail.
  Trainer other(
      job.config({"--training.steps=3", "--optimizer.eps=1e-3", "--training.local_batch_size=3"}),
      job.options());
  other.run();
  EXPECT_GT(rel_l2(weights(other), w[0]), 1e-4);
}

// Activation checkpointing recomputes with the same kernels on the same inputs: the trainer takes
// every mode, and every mode trains to the same bits (weights and AdamW moments), with a smaller
// activation estimate than saving everything.
TEST(Trainer, ActivationCheckpointModesAreBitIdentical) {
  Job job;
  auto train = [&](const std::vector<std::string>& ac) {
    std::vector<std::string> ov{"--training.steps=2", "--training.mixed_precision_param=bfloat16"};
    ov.insert(ov.end(), ac.begin(), ac.end());
    Trainer t(job.config(ov), job.options());
    const TrainResult r = t.run();
    return std::pair{r.steps, state_bits(t)};
  };
  const auto none = train({});
  for (const std::vector<std::string>& ac :
       {std::vector<std::string>{"--activation_checkpoint.mode=full"},
        {"--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=2"},
        {"--activation_checkpoint.mode=selective",
         "--activation_checkpoint.selective_option=op"}}) {
    const auto got = train(ac);
    ASSERT_EQ(got.first.size(), none.first.size());
    for (size_t i = 0; i < got.first.size(); ++i)
      EXPECT_EQ(got.first[i].loss, none.first[i].loss) << ac.back() << " step " << i + 1;
    EXPECT_EQ(got.second, none.second) << ac.back();
  }
  const ModelConfig mc = ModelConfig::from_file(job.path("model.json"));
  auto activations = [&](const std::vector<std::string>& ac) {
    return estimate_training_memory(job.config(ac), mc).activations;
  };
  const size_t all = activations({});
  for (const std::vector<std::string>& ac :
       {std::vector<std::string>{"--activation_checkpoint.mode=full"},
        {"--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"},
        {"--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=2"}})
    EXPECT_LT(activations(ac), all) << ac.back();
}

TEST(Trainer, NonFiniteLossStopsWithoutSaving) {
  Job job;
  Trainer t(job.config({"--optimizer.lr=1e30", "--training.steps=20", "--checkpoint.interval=1",
                        "--checkpoint.dir=" + job.path("ck"), "--checkpoint.keep=0",
                        "--metrics.jsonl=" + job.path("m.jsonl"), "--training.max_norm=1e30"}),
            job.options());
  std::string msg;
  try {
    t.run();
    ADD_FAILURE() << "expected the run to stop";
  } catch (const Error& e) {
    msg = e.what();
  }
  // The last JSONL line is the bad step (null for the non-finite values); its state is not saved
  // and no optimizer update was applied for it.
  const auto lines = read_jsonl(job.path("m.jsonl"));
  ASSERT_FALSE(lines.empty());
  const int64_t bad = lines.back()["step"].get<int64_t>();
  EXPECT_TRUE(lines.back()["loss"].is_null() || lines.back()["grad_norm"].is_null());
  EXPECT_NE(msg.find(str_cat("step ", bad, ":")), std::string::npos) << msg;
  EXPECT_NE(msg.find("step-" + std::string(8 - std::to_string(bad - 1).size(), '0') +
                     std::to_string(bad - 1)),
            std::string::npos)
      << msg;
  const auto kept = list_checkpoints(job.path("ck"));
  ASSERT_FALSE(kept.empty());
  EXPECT_EQ(kept.back().first, bad - 1);
  EXPECT_EQ(t.step(), bad - 1);
  EXPECT_EQ(t.optimizer().steps_taken(), bad - 1);
}

TEST(Trainer, InitFromAHuggingFaceDirectory) {
  Job job;
  std::vector<uint32_t> saved;
  {
    Trainer a(job.config({"--training.steps=2", "--checkpoint.dir=" + job.path("ck"),
                          "--checkpoint.last_save_in_hf=true"}),
              job.options());
    a.run();
    for (ParamUnit* u : a.model().units()) {
      const size_t at = saved.size();
      saved.resize(at + size_t(u->numel()));
      std::memcpy(saved.data() + at, u->flat().raw(), size_t(u->numel()) * 4);
    }
  }
  Trainer b(job.config({"--model.init_from=" + job.path("ck/step-00000002"), "--model.seed=77"}),
            job.options());
  EXPECT_EQ(b.step(), 0);
  std::vector<uint32_t> got;
  for (ParamUnit* u : b.model().units()) {
    const size_t at = got.size();
    got.resize(at + size_t(u->numel()));
    std::memcpy(got.data() + at, u->flat().raw(), size_t(u->numel()) * 4);
  }
  EXPECT_EQ(got, saved);
  // checkpoint.last_save_in_hf: the last checkpoint as a Hugging Face directory too.
  ASSERT_TRUE(fs::is_regular_file(job.path("ck/hf-step-00000002/model.safetensors")));
  ASSERT_TRUE(fs::is_regular_file(job.path("ck/hf-step-00000002/config.json")));
  EXPECT_EQ(list_checkpoints(job.path("ck")).size(), 1u);  // not taken for a checkpoint
  Trainer c(job.config({"--model.init_from=" + job.path("ck/hf-step-00000002"), "--model.seed=78"}),
            job.options());
  got.clear();
  for (ParamUnit* u : c.model().units()) {
    const size_t at = got.size();
    got.resize(at + size_t(u->numel()));
    std::memcpy(got.data() + at, u->flat().raw(), size_t(u->numel()) * 4);
  }
  EXPECT_EQ(got, saved);
  expect_error(
      [&] { Trainer(job.config({"--model.init_from=" + job.path("nope")}), job.options()); },
      {job.path("nope")});
}

TEST(Trainer, ShardVocabulary) {
  Job job;
  // Smaller than the model's: ids stay in range, training runs.
  fs::create_directories(job.path("small"));
  write_shard(job.path("small/train-00000.bin"), std::vector<int32_t>(300, 7), 40);
  Trainer t(job.config({"--data.path=" + job.path("small"), "--training.steps=1"}), job.options());
  EXPECT_EQ(t.run().steps.size(), 1u);
  // Larger: an error naming both numbers.
  fs::create_directories(job.path("big"));
  write_shard(job.path("big/train-00000.bin"), std::vector<int32_t>(300, 7), 64);
  expect_error([&] { Trainer(job.config({"--data.path=" + job.path("big")}), job.options()); },
               {"vocab_size 64", "vocab_size 48", job.path("big")});
  fs::create_directories(job.path("bigval"));
  write_shard(job.path("bigval/train-00000.bin"), std::vector<int32_t>(300, 7), 48);
  write_shard(job.path("bigval/val-00000.bin"), std::vector<int32_t>(300, 7), 50000);
  expect_error(
      [&] {
        Trainer(job.config({"--data.path=" + job.path("bigval"), "--validation.interval=1"}),
                job.options());
      },
      {"val", "vocab_size 50000", "vocab_size 48"});
}

TEST(Trainer, ConfigErrorsBeforeAnyWork) {
  Job job;
  auto err = [&](const std::vector<std::string>& ov, const std::vector<std::string>& parts) {
    expect_error([&] { Trainer(job.config(ov), job.options()); }, parts);
  };
  err({"--parallelism.tp=2"}, {"parallelism", "tp=2", "2 ranks"});
  err({"--parallelism.dp_shard=4"}, {"dp_shard=4", "4 ranks"});
  err({"--activation_checkpoint.mode=partial"},
      {"activation_checkpoint.mode", "partial", "none", "full", "selective"});
  err({"--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=0"},
      {"activation_checkpoint.selective_option", "op", "positive integer"});
  err({"--data.path="}, {"data.path", "empty"});
  err({"--data.path=" + job.path("absent")}, {"data.path", job.path("absent")});
  err({"--data.path=" + job.path("")}, {"train"});  // a directory without train-*.bin shards
  err({"--model.config=" + job.path("absent.json")}, {"absent.json"});
  err({"--checkpoint.interval=5"}, {"checkpoint.interval", "checkpoint.dir"});
  err({"--checkpoint.resume=true"}, {"checkpoint.resume", "checkpoint.dir"});
  err({"--data.tokenizer=" + job.path("tok.json")}, {"data.tokenizer", job.path("tok.json")});
  fs::create_directories(job.path("noval"));
  write_shard(job.path("noval/train-00000.bin"), std::vector<int32_t>(100, 1), 48);
  err({"--data.path=" + job.path("noval"), "--validation.interval=5"},
      {"validation.interval", "val-*.bin"});
  // Resuming from a corrupt checkpoint names the file.
  {
    Trainer t(job.config({"--training.steps=1", "--checkpoint.dir=" + job.path("ck")}),
              job.options());
    t.run();
  }
  const std::string f = job.path("ck/step-00000001/rank-00000.safetensors");
  fs::resize_file(f, fs::file_size(f) - 10);
  err({"--checkpoint.dir=" + job.path("ck"), "--checkpoint.resume=true"}, {f});
  // Resuming with another model shape names the tensor and both shapes.
  std::ofstream(job.path("wide.json")) << R"({"hidden_size": 64, "intermediate_size": 48,
      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
      "vocab_size": 48})";
  {
    Trainer t(job.config({"--training.steps=1", "--checkpoint.dir=" + job.path("ck2")}),
              job.options());
    t.run();
  }
  err({"--model.config=" + job.path("wide.json"), "--checkpoint.dir=" + job.path("ck2"),
       "--checkpoint.resume=true"},
      {"model config 'hidden_size' = 32 in the checkpoint, 64 now"});
  err({"--model.config=" + job.path("wide.json"), "--checkpoint.dir=" + job.path("ck2"),
       "--checkpoint.resume=true", "--checkpoint.allow_config_change=true"},
      {"model.embed_tokens.weight", "[48, 64]", "[48, 32]"});
  // The new keys are validated by the config parser.
  expect_error([&] { job.config({"--validation.interval=-1"}); }, {"validation.interval"});
  expect_error([&] { job.config({"--validation.steps=0"}); }, {"validation.steps"});
}

// A new run in a directory that holds another run's checkpoints would overwrite them, or save
// lower steps that pruning deletes at once (and a resume would then continue the other run): it
// is refused before any work, naming the directory and how to continue the other run.
TEST(Trainer, NewRunRefusesADirectoryWithAnotherRunsCheckpoints) {
  Job job;
  const std::string ck = job.path("ck");
  {
    Trainer a(job.config({"--training.steps=4", "--checkpoint.dir=" + ck, "--checkpoint.interval=2",
                          "--checkpoint.keep=2"}),
              job.options());
    a.run();
  }
  const auto before = list_checkpoints(ck);
  ASSERT_EQ(before.size(), 2u);
  expect_error(
      [&] {
        Trainer b(job.config({"--training.steps=3", "--model.seed=9", "--checkpoint.dir=" + ck,
                              "--checkpoint.interval=1", "--checkpoint.keep=2"}),
                  job.options());
        b.run();
      },
      {ck, "step-00000004", "--checkpoint.resume=true"});
  const auto after = list_checkpoints(ck);
  ASSERT_EQ(after.size(), 2u);
  EXPECT_EQ(after[0].first, 2);
  EXPECT_EQ(after[1].first, 4);
  EXPECT_EQ(read_text(before[1].second + "/state.json"),
            read_text(after[1].second + "/state.json"));
  // An empty (or absent) directory is fine.
  fs::create_directories(job.path("empty"));
  EXPECT_NO_THROW(Trainer(job.config({"--checkpoint.dir=" + job.path("empty")}), job.options()));
}

// A resume with keys that change the training math names them and refuses, unless
// checkpoint.allow_config_change; keys of the layout, logging and checkpointing are free.
TEST(Trainer, ResumeWithAChangedConfigurationNamesTheKeys) {
  Job job;
  const std::string ck = job.path("ck");
  {
    // Saves step 2 of 3, then step 3, which is removed: the run resumes at step 2 of 3.
    Trainer a(
        job.config({"--training.steps=3", "--checkpoint.dir=" + ck, "--checkpoint.interval=2"}),
        job.options());
    a.run();
    fs::remove_all(ck + "/step-00000003");
  }
  auto resume = [&](std::vector<std::string> ov) {
    ov.insert(ov.begin(), "--training.steps=3");
    ov.push_back("--checkpoint.dir=" + ck);
    ov.push_back("--checkpoint.resume=true");
    return job.config(ov);
  };
  expect_error(
      [&] {
        Trainer(resume({"--optimizer.lr=0.02", "--model.seed=4"}), job.options());
      },
      {ck, "optimizer.lr = 0.01 in the checkpoint, 0.02 now",
       "model.seed = 3 in the checkpoint, 4 now", "--checkpoint.allow_config_change=true"});
  // The global batch, not local_batch_size (which depends on the layout), is compared.
  expect_error([&] { Trainer(resume({"--training.local_batch_size=4"}), job.options()); },
               {"tokens per step", "32 in the checkpoint, 64 now"});
  // With the cosine schedule more steps change the learning rate of the steps to come (step 3).
  expect_error([&] { Trainer(resume({"--training.steps=6"}), job.options()); },
               {"training.steps = 3 in the checkpoint, 6 now", "step 3"});
  // Allowed explicitly: it resumes.
  {
    Trainer t(resume({"--training.steps=6", "--optimizer.lr=0.02",
                      "--checkpoint.allow_config_change=true"}),
              job.options());
    EXPECT_EQ(t.step(), 2);
  }
  // Keys that do not change the math are free.
  {
    Trainer t(resume({"--metrics.log_every=5", "--checkpoint.keep=1", "--validation.steps=3"}),
              job.options());
    EXPECT_EQ(t.step(), 2);
  }
}

// Limits of the data and the model that would otherwise show only late, or never: refused when
// the trainer is made, naming the key and the limit.
TEST(Trainer, RefusesSeqLenBeyondTheModelAndADatasetShorterThanASample) {
  Job job;
  expect_error([&] { Trainer(job.config({"--training.seq_len=4096"}), job.options()); },
               {"training.seq_len = 4096", "max_position_embeddings = 2048", "model.json"});
  EXPECT_NO_THROW(Trainer(job.config({"--training.seq_len=64"}), job.options()));
  // 10 tokens cannot make one sample of 16 + 1: the loader would wrap the same tokens around.
  fs::create_directories(job.path("tiny"));
  write_shard(job.path("tiny/train-00000.bin"), std::vector<int32_t>(10, 1), kVocab);
  expect_error([&] { Trainer(job.config({"--data.path=" + job.path("tiny")}), job.options()); },
               {job.path("tiny"), "train shards hold 10 tokens", "seq_len + 1 = 17"});
  write_shard(job.path("tiny/train-00000.bin"), std::vector<int32_t>(17, 1), kVocab);
  EXPECT_NO_THROW(Trainer(job.config({"--data.path=" + job.path("tiny")}), job.options()));
  write_shard(job.path("tiny/val-00000.bin"), std::vector<int32_t>(16, 1), kVocab);
  expect_error(
      [&] {
        Trainer(job.config({"--data.path=" + job.path("tiny"), "--validation.interval=1"}),
                job.options());
      },
      {"val shards hold 16 tokens"});
}

TEST(Trainer, RefusesAModelThatDoesNotFit) {
  Job job;
  // Llama 3 405B: ~6.5 TB of weights, gradients and AdamW state, checked against MemAvailable
  // before anything is allocated (and before the data is looked at).
  expect_error(
      [&] {
        Trainer(job.config({"--model.config=" + source_dir() + "/configs/llama3-405b.json",
                            "--data.path=" + job.path("absent")}),
                job.options());
      },
      {"not enough memory", "405", "parameters' weights and gradients", "TiB", "before any step",
       "MemAvailable"});
  const JobConfig bf16 = job.config({"--training.mixed_precision_param=bfloat16"});
  const MemoryEstimate m =
      estimate_training_memory(bf16, ModelConfig::from_file(job.path("model.json")));
  // f32 weights and gradients, a bf16 copy, AdamW's two moments (each rounded by the allocator).
  EXPECT_GE(m.states, 10 * m.params);
  EXPECT_GE(m.optimizer, 8 * m.params);
  EXPECT_GE(m.total(), m.states + m.optimizer + m.activations + m.workspace);
  // A budget just below the estimate fails; the estimate itself passes.
  TrainerOptions o = job.options();
  o.mem_available = m.total() - 1;
  expect_error([&] { Trainer(bf16, o); },
               {"not enough memory", std::to_string(m.params) + " parameters", "the given budget",
                "+ activations"});
  o.mem_available = m.total();
  EXPECT_NO_THROW(Trainer(bf16, o));
}

// The command line: --print-config, a bad override, and a stop signal finishing the step and
// saving.
TEST(TrainCommand, PrintConfigErrorsAndSigint) {
  const char* bin = std::getenv("LOOM_BIN");
  if (!bin || !fs::exists(bin)) GTEST_SKIP() << "LOOM_BIN (the loom binary) not built";
  Job job;
  const JobConfig c = job.config(
      {"--training.steps=1000000", "--checkpoint.dir=" + job.path("ck"), "--checkpoint.keep=1"});
  std::ofstream(job.path("job.toml")) << to_toml(c);
  const std::string base = str_cat(bin, " train --config ", job.path("job.toml"));

  const std::string printed = job.path("printed.toml");
  ASSERT_EQ(std::system((base + " --print-config --training.seq_len=8 > " + printed).c_str()), 0);
  JobConfig expect = c;
  expect.training.seq_len = 8;
  EXPECT_EQ(load_job_config(printed, {}), expect);
  const std::string err = job.path("err.txt");
  EXPECT_NE(std::system((base + " --training.seq_len=zero 2> " + err).c_str()), 0);
  EXPECT_NE(read_text(err).find("training.seq_len"), std::string::npos) << read_text(err);

  // A stop signal once the first steps are out: exit 3 (stopped, not finished) with a checkpoint
  // of the last finished step. SIGINT from a terminal, SIGUSR2 as mpirun forwards it.
  const std::string toml = job.path("job.toml");
  for (const int sig : {SIGINT, SIGUSR2}) {
    SCOPED_TRACE(strsignal(sig));
    const std::string log = job.path(str_cat("train-", sig, ".log"));
    const std::string ck = "--checkpoint.dir=" + job.path(str_cat("ck-", sig));
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // the child execs loom itself, so the signal goes to loom and not to a shell
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execl(bin, bin, "train", "--config", toml.c_str(), ck.c_str(), (char*)nullptr);
      ::_exit(127);
    }
    bool started = false;
    for (int i = 0; i < 1000 && !started; ++i) {
      ::usleep(10000);
      started = read_text(log).find("      2/1000000 | loss") != std::string::npos;
    }
    EXPECT_TRUE(started) << read_text(log).substr(0, 2000);
    ::kill(pid, sig);
    int status = 0;
    ::waitpid(pid, &status, 0);
    const std::string tail =
        read_text(log).substr(std::max<size_t>(read_text(log).size(), 2000) - 2000);
    ASSERT_TRUE(WIFEXITED(status)) << tail;
    EXPECT_EQ(WEXITSTATUS(status), 3) << tail;
    const auto kept = list_checkpoints(job.path(str_cat("ck-", sig)));
    ASSERT_EQ(kept.size(), 1u) << tail;
    EXPECT_GE(kept.back().first, 2);
    EXPECT_LT(kept.back().first, 1000000);
    EXPECT_NE(tail.find("interrupted"), std::string::npos) << tail;
  }
}

TEST(Metrics, JsonProgressAndDurations) {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 1500;
  m.loss = 3.25;
  m.lr = 1e-3;
  m.grad_norm = std::nan("");
  m.tokens_per_s = 12345.5;
  m.mfu = 0.2;
  m.peak_allocated_bytes = 3u << 20;
  m.eta_seconds = 125;
  const auto j = nlohmann::json::parse(step_json(m));  // valid JSON even with a NaN in it
  EXPECT_EQ(j["step"], 12);
  EXPECT_EQ(j["loss"].get<double>(), 3.25);
  EXPECT_TRUE(j["grad_norm"].is_null());
  EXPECT_EQ(j["peak_allocated_bytes"].get<size_t>(), size_t(3) << 20);
  EXPECT_EQ(nlohmann::json::parse(validation_json(7, 2.5))["val_loss"].get<double>(), 2.5);
  const std::string p = progress_text(m);
  for (const char* part : {"step   12/1500", "loss 3.2500", "lr 1.00e-03", "grad nan",
                           "12.3k tok/s", "MFU 20.0%", "mem 3 MiB", "ETA 2m05s"})
    EXPECT_NE(p.find(part), std::string::npos) << part << " in " << p;
  EXPECT_EQ(format_duration(42.4), "42s");
  EXPECT_EQ(format_duration(7500), "2h05m");
  EXPECT_EQ(format_duration(-1), "?");
}

// A metrics file that cannot be written (a full disk: /dev/full) ends the run with an error
// naming the file, instead of a 0-byte metrics.jsonl and exit 0.
TEST(Metrics, WriteErrorsEndTheRun) {
  MetricsLogger::Options o;
  FILE* null_out = std::fopen("/dev/null", "w");
  o.out = null_out;
  o.jsonl = "/dev/full";
  {
    MetricsLogger log(o);
    StepMetrics m;
    m.step = 1;
    m.total_steps = 2;
    expect_error([&] { log.step(m); }, {"metrics.jsonl", "/dev/full", "No space left"});
    expect_error([&] { log.validation(1, 2.0); }, {"metrics.jsonl", "/dev/full"});
  }
  std::fclose(null_out);
  Job job;
  Trainer t(job.config({"--training.steps=2", "--metrics.jsonl=/dev/full"}), job.options());
  expect_error([&] { t.run(); }, {"metrics.jsonl", "/dev/full", "No space left"});
}

// A closed stdout (`loom train | head`, a `| tee` that Ctrl-C ended) does not end the run, as a
// full metrics file does: the loss of the output is noted once, on stderr and in the rank log, the
// printer stops writing to it and the JSONL file still gets every line.
TEST(Metrics, AClosedPipeIsNotedOnceAndTheRunGoesOn) {
  struct IgnoreSigpipe {  // as `loom train` does: EPIPE instead of death by SIGPIPE
    struct sigaction old {};
    IgnoreSigpipe() {
      struct sigaction sa {};
      sa.sa_handler = SIG_IGN;
      sigaction(SIGPIPE, &sa, &old);
    }
    ~IgnoreSigpipe() { sigaction(SIGPIPE, &old, nullptr); }
  } ignore;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[0]);  // the reader has gone
  std::unique_ptr<FILE, int (*)(FILE*)> out(::fdopen(fds[1], "w"), &std::fclose);
  std::unique_ptr<FILE, int (*)(FILE*)> rank_log(std::tmpfile(), &std::fclose);
  ASSERT_TRUE(out && rank_log);
  Job job;
  MetricsLogger::Options o;
  o.out = out.get();
  o.jsonl = job.path("m.jsonl");
  o.note_lost_out = rank_log.get();
  testing::internal::CaptureStderr();
  {
    MetricsLogger log(o);
    StepMetrics m;
    m.total_steps = 3;
    for (m.step = 1; m.step <= 3; ++m.step) log.step(m);
    log.validation(3, 2.0);
    log.message("saved");
  }
  const std::string err = testing::internal::GetCapturedStderr();
  const std::string note = "cannot write progress to its log (Broken pipe)";
  EXPECT_NE(err.find(note), std::string::npos) << err;
  EXPECT_EQ(err.find(note), err.rfind(note)) << "noted more than once: " << err;
  std::rewind(rank_log.get());
  char line[512] = {};
  ASSERT_NE(std::fgets(line, sizeof line, rank_log.get()), nullptr);
  EXPECT_NE(std::string(line).find(note), std::string::npos) << line;
  EXPECT_EQ(std::fgets(line, sizeof line, rank_log.get()), nullptr) << "noted twice: " << line;
  std::ifstream jsonl(o.jsonl);
  std::string text((std::istreambuf_iterator<char>(jsonl)), std::istreambuf_iterator<char>());
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 4) << text;
}

// A checkpoint directory that fills up: the error says that keep + 1 checkpoints must fit, and
// the last complete checkpoint is left. Needs a small file system (tmpfs, mounted as root).
TEST(Trainer, OutOfSpaceSaysThatKeepPlusOneCheckpointsMustFit) {
  Job job;
  const std::string mnt = job.path("small");
  fs::create_directories(mnt);
  if (std::system(("mount -t tmpfs -o size=320k tmpfs " + mnt + " 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root)";
  struct Unmount {
    std::string dir;
    ~Unmount() { (void)std::system(("umount " + dir).c_str()); }
  } unmount{mnt};
  // Synchronous and asynchronous saves: the error names the file being written, the previous
  // checkpoint is intact, nothing half-written is left.
  for (const char* async : {"false", "true"}) {
    const std::string ck = mnt + "/ck";
    fs::remove_all(ck);
    expect_error(
        [&] {
          Trainer t(
              job.config({"--training.steps=3", "--checkpoint.dir=" + ck, "--checkpoint.interval=1",
                          "--checkpoint.keep=1", std::string("--checkpoint.async=") + async}),
              job.options());
          t.run();
        },
        {"No space left", ck, "rank-00000.safetensors", "checkpoint.keep + 1 = 2 checkpoints"});
    const auto left = list_checkpoints(ck);
    ASSERT_EQ(left.size(), 1u) << "async " << async;
    EXPECT_EQ(left[0].first, 1);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(ck))
      if (e.path().filename() != CheckpointDirLock::kFileName)
        names.push_back(e.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"step-00000001"}) << "async " << async;
  }
}

// checkpoint.async: the same checkpoints as synchronous saves, byte for byte, each complete by
// the next save and at the end, pruned to `keep`; and a resume from them is the same.
TEST(Trainer, AsyncSavesWriteTheSameCheckpoints) {
  Job job;
  auto run = [&](const std::string& dir, bool async, int64_t keep) {
    Trainer t(job.config({"--training.steps=5", "--checkpoint.interval=2",
                          "--checkpoint.dir=" + job.path(dir),
                          "--checkpoint.keep=" + std::to_string(keep),
                          std::string("--checkpoint.async=") + (async ? "true" : "false")}),
              job.options());
    return t.run();
  };
  const TrainResult a = run("sync", false, 0), b = run("async", true, 0);
  EXPECT_EQ(fs::path(b.last_checkpoint).filename(), "step-00000005");
  const auto ca = list_checkpoints(job.path("sync")), cb = list_checkpoints(job.path("async"));
  ASSERT_EQ(cb.size(), 3u);  // steps 2, 4 and 5
  ASSERT_EQ(ca.size(), cb.size());
  for (size_t i = 0; i < ca.size(); ++i) {
    EXPECT_EQ(ca[i].first, cb[i].first);
    for (const char* f : {"rank-00000.safetensors", "loom.index.json"})
      EXPECT_TRUE(read_text(ca[i].second + "/" + f) == read_text(cb[i].second + "/" + f))
          << cb[i].second << "/" << f;
    // state.json differs in the config (checkpoint.dir, checkpoint.async) only.
    const TrainState sa = read_checkpoint_state(ca[i].second),
                     sb = read_checkpoint_state(cb[i].second);
    EXPECT_EQ(sa.step, sb.step);
    EXPECT_EQ(sa.data_step, sb.data_step);
    EXPECT_EQ(sa.lr, sb.lr);
    EXPECT_EQ(sa.loss, sb.loss);
    // Nothing of the background protocol is left behind.
    for (const auto& e : fs::directory_iterator(cb[i].second))
      EXPECT_EQ(e.path().extension() == ".done" || e.path().extension() == ".error", false)
          << e.path();
  }
  run("async_keep", true, 1);
  const auto kept = list_checkpoints(job.path("async_keep"));
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].first, 5);
}

// The same with a writer slower than the steps (a test hook: 4 KiB pieces, 2 ms before each), so
// that the next AdamW update comes while it is half-way: before_modify copies the rest and the
// files are still the synchronous saves'. The anti-test: with the copy skipped, the writer reads
// shards the updates changed and the files differ.
TEST(Trainer, AsyncSavesWithASlowWriterWriteTheSameCheckpoints) {
  Job job;
  auto run = [&](const std::string& dir, bool async) {
    Trainer t(job.config({"--training.steps=5", "--checkpoint.interval=2",
                          "--checkpoint.dir=" + job.path(dir),
                          std::string("--checkpoint.async=") + (async ? "true" : "false")}),
              job.options());
    return t.run();
  };
  struct Reset {
    ~Reset() { async_save_testing() = {}; }
  } reset;
  run("sync", false);
  const auto ca = list_checkpoints(job.path("sync"));
  ASSERT_EQ(ca.size(), 3u);
  for (const bool skip : {false, true}) {
    AsyncSaveTesting& hooks = async_save_testing();
    hooks.piece_bytes = 4096;
    hooks.skip_copy = skip;
    hooks.before_piece = [](int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); };
    const std::string dir = skip ? "async_skip" : "async";
    run(dir, true);
    async_save_testing() = {};
    const auto cb = list_checkpoints(job.path(dir));
    ASSERT_EQ(cb.size(), ca.size());
    int same = 0;
    for (size_t i = 0; i < ca.size(); ++i) {
      const std::string f = "/rank-00000.safetensors";
      same += read_text(ca[i].second + f) == read_text(cb[i].second + f);
    }
    // The last save has no update after it: the end of training waits for it.
    if (skip)
      EXPECT_EQ(same, 1) << "the anti-test: steps 2 and 4 read changed shards";
    else
      EXPECT_EQ(same, 3);
  }
}

// A corrupt latest checkpoint (a byte of its rank file flipped): the resume stops with an error
// naming the file and the previous complete checkpoint, unless checkpoint.fallback = true: then
// it says so and resumes from the previous one, with the losses of a resume from that one where
// it is the latest.
TEST(Trainer, CorruptLatestCheckpointFallsBackOnlyWhenAsked) {
  Job job;
  auto cfg = [&](const std::string& dir, int64_t steps, std::vector<std::string> extra) {
    extra.insert(extra.end(),
                 {"--lr_scheduler.decay_type=none", "--checkpoint.interval=2",
                  str_cat("--training.steps=", steps), "--checkpoint.dir=" + job.path(dir)});
    return job.config(extra);
  };
  Trainer(cfg("a", 4, {}), job.options()).run();  // saves steps 2 and 4
  fs::copy(job.path("a"), job.path("b"), fs::copy_options::recursive);
  fs::remove_all(job.path("b/step-00000004"));  // b: step 2 is the latest
  const std::string rank0 = job.path("a/step-00000004/rank-00000.safetensors");
  {
    std::fstream f(rank0, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(-4, std::ios::end);
    const char c = char(f.get());  // flipped: whatever it was, it changes
    f.seekp(-4, std::ios::end);
    f.put(char(~c));
  }
  expect_error([&] { Trainer(cfg("a", 6, {"--checkpoint.resume=true"}), job.options()); },
               {rank0, "checksum mismatch",
                "the previous complete checkpoint is " + job.path("a/step-00000002"),
                "--checkpoint.fallback=true"});

  const std::string log_path = job.path("fallback.log");
  FILE* log = std::fopen(log_path.c_str(), "w");
  ASSERT_NE(log, nullptr);
  TrainerOptions o = job.options();
  o.out = log;
  Trainer fa(cfg("a", 6, {"--checkpoint.resume=true", "--checkpoint.fallback=true"}), o);
  EXPECT_EQ(fa.step(), 2);
  const TrainResult ra = fa.run();
  std::fclose(log);
  const std::string text = read_text(log_path);
  for (const std::string& part :
       {"skipping checkpoint " + job.path("a/step-00000004"), rank0, std::string("checksum"),
        "resumed from " + job.path("a/step-00000002")})
    EXPECT_NE(text.find(part), std::string::npos) << part << " in\n" << text;

  Trainer fb(cfg("b", 6, {"--checkpoint.resume=true"}), job.options());
  EXPECT_EQ(fb.step(), 2);
  const TrainResult rb = fb.run();
  ASSERT_EQ(ra.steps.size(), 4u);
  ASSERT_EQ(rb.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ra.steps[i].step, rb.steps[i].step);
    EXPECT_EQ(ra.steps[i].loss, rb.steps[i].loss) << "step " << ra.steps[i].step;
  }
  EXPECT_EQ(state_bits(fa), state_bits(fb));
}
