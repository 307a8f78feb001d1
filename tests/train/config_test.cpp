#include "train/config.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "kernels/cpu/gemm.hpp"
#include "model/llama_config.hpp"
#include "model/model_config.hpp"
#include "ops/devices.hpp"
#include "tests/temp_dir.hpp"
#include "tests/test_util.hpp"
#include "train/launch.hpp"

namespace fs = std::filesystem;
using loom::JobConfig;

namespace {

using loom::test::TempDir;

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

using loom::test::expect_error;

JobConfig parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_job_config(text, "job.toml", ov);
}

void write_text(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << s;
}

}  // namespace

TEST(JobConfig, DefaultsWhenEmpty) {
  JobConfig c = parse("");
  EXPECT_EQ(c, JobConfig{});
  EXPECT_EQ(c.job.name, "loom");
  EXPECT_EQ(c.job.dump_dir, "runs");
  EXPECT_EQ(c.model.seed, 1234);
  EXPECT_EQ(c.training.steps, 100);
  EXPECT_EQ(c.training.local_batch_size, 8);
  EXPECT_EQ(c.training.seq_len, 256);
  EXPECT_EQ(c.training.max_norm, 1.0);
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.lr_scheduler.decay_type, "cosine");
  EXPECT_EQ(c.parallelism.dp_shard, -1);
  EXPECT_TRUE(c.parallelism.tp_sequence_parallel);
  EXPECT_EQ(c.parallelism.pp_schedule, "1f1b");
  EXPECT_EQ(c.activation_checkpoint.selective_option, "op");
  EXPECT_EQ(c.checkpoint.keep, 3);
  EXPECT_EQ(c.bench.steps, 5);
  EXPECT_EQ(c.memory.limit_gb, 0);
}

TEST(JobConfig, ParsesEverySectionWithTypes) {
  JobConfig c = parse(R"(
[job]
name = "run1"
[model]
config = "debug"
seed = 7
[data]
path = "/data/shards"
shuffle = true
[training]
steps = 1000
seq_len = 2048
max_norm = 2        # an integer where a number is expected is fine
mixed_precision_param = "bfloat16"
[optimizer]
lr = 1.5e-3
beta2 = 0.999
[lr_scheduler]
decay_type = "wsd"
decay_ratio = 0.2
[parallelism]
dp_shard = 4
tp = 2
fsdp_reshard_after_forward = "never"
tp_sequence_parallel = false
pp_schedule = "interleaved_1f1b"
[activation_checkpoint]
mode = "selective"
selective_option = 2
[checkpoint]
interval = 50
resume = true
[metrics]
jsonl = "m.jsonl"
[bench]
warmup_steps = 0
[memory]
limit_gb = 12.5
)");
  EXPECT_EQ(c.job.name, "run1");
  EXPECT_EQ(c.model.config, "debug");
  EXPECT_EQ(c.model.seed, 7);
  EXPECT_EQ(c.data.path, "/data/shards");
  EXPECT_TRUE(c.data.shuffle);
  EXPECT_EQ(c.training.steps, 1000);
  EXPECT_EQ(c.training.seq_len, 2048);
  EXPECT_EQ(c.training.max_norm, 2.0);
  EXPECT_EQ(c.training.mixed_precision_param, "bfloat16");
  EXPECT_EQ(c.training.mixed_precision_reduce, "float32");
  EXPECT_EQ(c.optimizer.lr, 1.5e-3);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.lr_scheduler.decay_type, "wsd");
  EXPECT_EQ(c.lr_scheduler.decay_ratio, 0.2);
  EXPECT_EQ(c.parallelism.dp_shard, 4);
  EXPECT_EQ(c.parallelism.tp, 2);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "never");
  EXPECT_FALSE(c.parallelism.tp_sequence_parallel);
  EXPECT_EQ(c.parallelism.pp_schedule, "interleaved_1f1b");
  EXPECT_EQ(c.activation_checkpoint.mode, "selective");
  EXPECT_EQ(c.activation_checkpoint.selective_option, "2");
  EXPECT_EQ(c.checkpoint.interval, 50);
  EXPECT_TRUE(c.checkpoint.resume);
  EXPECT_EQ(c.metrics.jsonl, "m.jsonl");
  EXPECT_EQ(c.bench.warmup_steps, 0);
  EXPECT_EQ(c.memory.limit_gb, 12.5);
}

TEST(JobConfig, OverridesWinInOrderAndParseByType) {
  JobConfig c = parse(
      "[training]\nsteps = 10\n[data]\npath = \"a\"\n",
      {"--training.steps=20", "--training.steps=30", "--optimizer.lr=1e-2",
       "--optimizer.beta1=+0.5", "--data.path=\"b c\"", "--job.name='x=y'",
       "--data.tokenizer=tok.json", "--data.shuffle=true", "--parallelism.dp_shard=-1",
       "--memory.limit_gb=3", "--metrics.jsonl=", "--activation_checkpoint.selective_option=op"});
  EXPECT_EQ(c.training.steps, 30);
  EXPECT_EQ(c.optimizer.lr, 1e-2);
  EXPECT_EQ(c.optimizer.beta1, 0.5);
  EXPECT_EQ(c.data.path, "b c");
  EXPECT_EQ(c.job.name, "x=y");  // only the first '=' separates key and value
  EXPECT_EQ(c.data.tokenizer, "tok.json");
  EXPECT_TRUE(c.data.shuffle);
  EXPECT_EQ(c.parallelism.dp_shard, -1);
  EXPECT_EQ(c.memory.limit_gb, 3.0);
  EXPECT_EQ(c.metrics.jsonl, "");
}

TEST(JobConfig, ToTomlRoundTrips) {
  // Defaults, and a config with awkward values: strings needing escapes, floats that print
  // long, integers in float keys, negative ints.
  JobConfig a = parse("");
  EXPECT_EQ(parse(loom::to_toml(a)), a);
  JobConfig b = parse(R"(
[job]
name = "quote \" back \\ tab	 unicode é"
[optimizer]
lr = 0.00012345678901234567
eps = 1e-12
weight_decay = 0
beta1 = 0.1
[lr_scheduler]
min_lr_ratio = 0.3333333333333333
[memory]
limit_gb = 1e3
[parallelism]
dp_shard = -1
cp_rotate_method = "allgather"
)",
                      {"--model.seed=9007199254740993", "--job.dump_dir=/tmp/x y"});
  const std::string text = loom::to_toml(b);
  JobConfig b2 = parse(text);
  EXPECT_EQ(b2, b) << text;
  EXPECT_EQ(b2.job.name, "quote \" back \\ tab\t unicode é");
  EXPECT_EQ(b2.optimizer.lr, 0.00012345678901234567);
  EXPECT_EQ(b2.model.seed, 9007199254740993LL);
  // Every section is written.
  for (const char* s : {"[job]", "[model]", "[moe]", "[data]", "[training]", "[optimizer]",
                        "[lr_scheduler]", "[parallelism]", "[activation_checkpoint]",
                        "[checkpoint]", "[metrics]", "[bench]", "[memory]"})
    EXPECT_NE(text.find(s), std::string::npos) << s;
  // A changed value makes the configs differ (operator== looks at the keys).
  b2.parallelism.cp = 2;
  EXPECT_FALSE(b2 == b);
}

// [job] collective_timeout_s: the collective timeout of multi-process runs (the multi-host drill,
// tests/drill/, sets a short one); positive.
TEST(JobConfig, CollectiveTimeout) {
  EXPECT_EQ(parse("").job.collective_timeout_s, 300);
  EXPECT_EQ(parse("[job]\ncollective_timeout_s = 5\n").job.collective_timeout_s, 5);
  EXPECT_EQ(parse("", {"--job.collective_timeout_s=2.5"}).job.collective_timeout_s, 2.5);
  expect_error([] { parse("", {"--job.collective_timeout_s=0"}); },
               {"job.collective_timeout_s", "positive", "command line"});
}

TEST(JobConfig, ErrorsNameKeyAndSource) {
  expect_error([] { parse("[trainng]\nsteps = 3\n"); },
               {"job.toml:1", "unknown section [trainng]", "training"});
  expect_error([] { parse("[training]\nstep = 3\n"); }, {"job.toml:2", "training.step", "seq_len"});
  expect_error([] { parse("steps = 3\n"); }, {"job.toml", "unknown section [steps]"});
  expect_error([] { parse("[training]\nseq_len = \"long\"\n"); },
               {"job.toml:2", "training.seq_len", "integer", "string"});
  expect_error([] { parse("[training]\nseq_len = 2.5\n"); },
               {"job.toml", "training.seq_len", "integer"});
  expect_error([] { parse("[optimizer]\nlr = \"fast\"\n"); }, {"optimizer.lr", "number"});
  expect_error([] { parse("[data]\nshuffle = 1\n"); }, {"data.shuffle", "true or false"});
  expect_error([] { parse("[data]\npath = 3\n"); }, {"data.path", "string"});
  expect_error([] { parse("[training\n"); }, {"job.toml:1", "invalid TOML"});
  expect_error([] { parse("[training.sub]\nx = 1\n"); }, {"training.sub"});

  // Out of range, from the file and from the command line.
  expect_error([] { parse("[training]\nsteps = 0\n"); },
               {"job.toml:2", "training.steps", "positive", "0"});
  expect_error([] { parse("", {"--training.seq_len=-5"}); },
               {"command line", "training.seq_len", "positive", "-5"});
  expect_error([] { parse("", {"--training.local_batch_size=0"}); },
               {"command line", "training.local_batch_size"});
  expect_error([] { parse("[optimizer]\nlr = -1e-3\n"); }, {"job.toml:2", "optimizer.lr"});
  expect_error([] { parse("", {"--optimizer.beta1=1"}); },
               {"command line", "optimizer.beta1", "[0, 1)"});
  expect_error([] { parse("", {"--optimizer.beta2=-0.1"}); }, {"optimizer.beta2", "[0, 1)"});
  expect_error([] { parse("", {"--parallelism.dp_shard=0"}); }, {"parallelism.dp_shard", "-1"});
  expect_error([] { parse("", {"--parallelism.tp=0"}); }, {"parallelism.tp", "positive"});
  expect_error([] { parse("", {"--optimizer.lr=nan"}); }, {"optimizer.lr"});
  expect_error([] { parse("[training]\nmixed_precision_param = \"float16\"\n"); },
               {"job.toml:2", "training.mixed_precision_param",
                "\"float32\", \"bfloat16\", \"auto\"", "float16"});
  expect_error(
      [] { parse("", {"--lr_scheduler.decay_type=step"}); },
      {"command line", "lr_scheduler.decay_type", "\"cosine\", \"linear\", \"wsd\", \"none\""});
  expect_error([] { parse("", {"--parallelism.pp_schedule=zb"}); },
               {"parallelism.pp_schedule", "gpipe", "interleaved_1f1b"});
  expect_error([] { parse("", {"--optimizer.name=sgd"}); }, {"optimizer.name", "adamw"});
  expect_error([] { parse("", {"--activation_checkpoint.mode=some"}); },
               {"activation_checkpoint.mode", "selective"});
  expect_error([] { parse("", {"--activation_checkpoint.selective_option=0"}); },
               {"activation_checkpoint.selective_option", "op"});
  expect_error([] { parse("", {"--parallelism.cp_rotate_method=ring"}); },
               {"parallelism.cp_rotate_method", "p2p"});
  expect_error([] { parse("", {"--parallelism.fsdp_reshard_after_forward=sometimes"}); },
               {"parallelism.fsdp_reshard_after_forward", "always"});
  // Pipeline keys: the schedule's rules named by their keys, checked when pp > 1.
  expect_error(
      [] {
        parse("", {"--parallelism.pp=4", "--parallelism.pp_microbatches=3"});
      },
      {"parallelism.pp_microbatches (3)", "parallelism.pp (4)", "1f1b"});
  expect_error(
      [] {
        parse("", {"--parallelism.pp=2", "--parallelism.pp_schedule=interleaved_1f1b",
                   "--parallelism.pp_microbatches=3"});
      },
      {"interleaved_1f1b", "multiple", "parallelism.pp_microbatches (3)"});
  expect_error(
      [] {
        parse("", {"--parallelism.pp=2", "--parallelism.pp_schedule=zbv",
                   "--parallelism.pp_stages_per_rank=4"});
      },
      {"zbv", "parallelism.pp_stages_per_rank = 2"});
  expect_error([] { parse("", {"--parallelism.pp_stages_per_rank=-1"}); },
               {"parallelism.pp_stages_per_rank", "non-negative"});
  expect_error([] { parse("", {"--parallelism.pp_stage_layers=3,x"}); },
               {"parallelism.pp_stage_layers", "\"x\""});
  expect_error([] { parse("", {"--parallelism.pp_fsdp_gather=unit"}); },
               {"parallelism.pp_fsdp_gather", "microbatch"});
  EXPECT_EQ(parse("", {"--parallelism.pp=2", "--parallelism.pp_fsdp_gather=step"})
                .parallelism.pp_fsdp_gather,
            "step");
  EXPECT_NO_THROW(parse("", {"--parallelism.pp=4", "--parallelism.pp_schedule=interleaved_1f1b",
                             "--parallelism.pp_microbatches=8"}));

  // Malformed overrides and wrong types on the command line.
  expect_error([] { parse("", {"--training.steps"}); }, {"command line", "malformed", "="});
  expect_error([] { parse("", {"--steps=3"}); }, {"command line", "malformed", "--steps=3"});
  expect_error([] { parse("", {"training.steps=3"}); }, {"command line", "malformed"});
  expect_error([] { parse("", {"--.steps=3"}); }, {"command line", "malformed"});
  expect_error([] { parse("", {"--training.stepz=3"}); }, {"command line", "training.stepz"});
  expect_error([] { parse("", {"--nope.steps=3"}); }, {"command line", "[nope]"});
  expect_error([] { parse("", {"--training.steps=ten"}); },
               {"command line", "training.steps", "integer", "ten"});
  expect_error([] { parse("", {"--training.steps=10x"}); }, {"training.steps", "integer"});
  expect_error([] { parse("", {"--training.steps="}); }, {"training.steps", "integer"});
  expect_error([] { parse("", {"--optimizer.lr=0.1.2"}); }, {"optimizer.lr", "number"});
  expect_error([] { parse("", {"--data.shuffle=yes"}); }, {"data.shuffle", "true or false"});
}

// "auto" is resolved while parsing: bfloat16 exactly where oneDNN has native bf16 matmuls (and the
// GEMMs run them), float32 elsewhere; the concrete dtype is what to_toml writes (with the reason as
// a comment) and what parses back. A value set explicitly carries no reason.
TEST(JobConfig, AutoPrecisionResolvesToConcreteDtype) {
  const JobConfig c = parse("[training]\nmixed_precision_param = \"auto\"\n");
  const bool bf16 = loom::cpu::cpu_isa().onednn_native_bf16 && loom::cpu::gemm_bf16_native();
  EXPECT_EQ(c.training.mixed_precision_param, bf16 ? "bfloat16" : "float32");
  EXPECT_EQ(c.precision_reason.rfind("auto: oneDNN ", 0), 0u) << c.precision_reason;
  const std::string text = loom::to_toml(c);
  EXPECT_NE(
      text.find("mixed_precision_param = \"" + c.training.mixed_precision_param + "\"  # auto"),
      std::string::npos)
      << text;
  const JobConfig back = parse(text);
  EXPECT_EQ(back, c);
  EXPECT_TRUE(back.precision_reason.empty());
  EXPECT_NE(loom::describe_precision(c).find(c.precision_reason), std::string::npos);
  // From the command line too, and an explicit bfloat16 stays bfloat16 on every CPU.
  EXPECT_EQ(parse("", {"--training.mixed_precision_param=auto"}).training.mixed_precision_param,
            c.training.mixed_precision_param);
  const JobConfig b = parse("", {"--training.mixed_precision_param=bfloat16"});
  EXPECT_EQ(b.training.mixed_precision_param, "bfloat16");
  EXPECT_NE(loom::describe_precision(b).find("bf16 GEMMs " + loom::cpu::gemm_bf16_path()),
            std::string::npos)
      << loom::describe_precision(b);
}

TEST(JobConfig, LoadFromFileAndShippedConfigs) {
  TempDir t;
  write_text(t.path() / "job.toml", "[training]\nsteps = 5\n");
  JobConfig c = loom::load_job_config((t.path() / "job.toml").string(), {"--training.seq_len=32"});
  EXPECT_EQ(c.training.steps, 5);
  EXPECT_EQ(c.training.seq_len, 32);
  EXPECT_EQ(c.base_dir, t.path().string());
  expect_error([&] { loom::load_job_config((t.path() / "none.toml").string(), {}); },
               {"none.toml"});
  write_text(t.path() / "bad.toml", "[training]\nsteps = -1\n");
  expect_error([&] { loom::load_job_config((t.path() / "bad.toml").string(), {}); },
               {(t.path() / "bad.toml").string() + ":2", "training.steps"});

  const fs::path cfg = fs::path(source_dir()) / "configs";
  struct Shipped {
    const char* file;
    const char* model;
    int64_t seq_len, batch, steps;
  };
  for (const Shipped& s : {Shipped{"bench-tiny.toml", "bench-tiny", 256, 8, 7},
                           Shipped{"bench-small.toml", "bench-small", 256, 8, 7},
                           Shipped{"debug.toml", "debug", 64, 4, 20},
                           Shipped{"default.toml", "default", 256, 8, 300}}) {
    JobConfig j = loom::load_job_config((cfg / s.file).string(), {});
    EXPECT_EQ(j.model.config, s.model) << s.file;
    EXPECT_EQ(j.training.seq_len, s.seq_len) << s.file;
    EXPECT_EQ(j.training.local_batch_size, s.batch) << s.file;
    EXPECT_EQ(j.training.steps, s.steps) << s.file;
    // The model name resolves to a config.json that parses.
    const std::string path = loom::resolve_model_config(j.model.config, j.base_dir);
    EXPECT_EQ(fs::path(path), (cfg / (std::string(s.model) + ".json")).lexically_normal());
    EXPECT_NO_THROW(loom::LlamaConfig::from_file(path));
  }
}

TEST(JobConfig, ResolveModelConfigSearchOrder) {
  TempDir t;
  const fs::path root = t.path();
  // A TOML file in root/exp; configs/NAME.json next to it (root/configs) and a different one in
  // root/src/configs ($LOOM_SOURCE_DIR).
  write_text(root / "exp" / "job.toml", "");
  write_text(root / "configs" / "m.json", "{}");
  write_text(root / "src" / "configs" / "m.json", "{}");
  write_text(root / "src" / "configs" / "only_src.json", "{}");
  write_text(root / "exp" / "local.json", "{}");
  write_text(root / "exp" / "sub" / "x.json", "{}");

  const char* old = std::getenv("LOOM_SOURCE_DIR");
  const std::string saved = old ? old : "";
  ::setenv("LOOM_SOURCE_DIR", (root / "src").c_str(), 1);
  const std::string exp = (root / "exp").string();
  EXPECT_EQ(loom::resolve_model_config("m", exp), (root / "configs" / "m.json").string());
  EXPECT_EQ(loom::resolve_model_config("only_src", exp),
            (root / "src" / "configs" / "only_src.json").string());
  // Paths: relative to the TOML file's directory, or absolute.
  EXPECT_EQ(loom::resolve_model_config("local.json", exp), (root / "exp" / "local.json").string());
  EXPECT_EQ(loom::resolve_model_config("sub/x.json", exp),
            (root / "exp" / "sub" / "x.json").string());
  EXPECT_EQ(loom::resolve_model_config((root / "configs" / "m.json").string(), ""),
            (root / "configs" / "m.json").string());
  // A path is not searched for in configs/ and a name is not taken as a path.
  expect_error([&] { loom::resolve_model_config("sub/m.json", exp); },
               {"sub/m.json", (root / "exp" / "sub" / "m.json").string()});
  expect_error([&] { loom::resolve_model_config("absent", exp); },
               {"'absent'", (root / "configs" / "absent.json").string(), "configs/absent.json",
                (root / "src" / "configs" / "absent.json").string(), "share/loom/configs"});
  expect_error([&] { loom::resolve_model_config("", exp); }, {"model.config", "empty"});
  if (old)
    ::setenv("LOOM_SOURCE_DIR", saved.c_str(), 1);
  else
    ::unsetenv("LOOM_SOURCE_DIR");
}

TEST(JobConfig, ValidationKeys) {
  JobConfig d = parse("");
  EXPECT_EQ(d.validation.interval, 0);  // off unless asked for
  EXPECT_EQ(d.validation.steps, 10);
  JobConfig c = parse("[validation]\ninterval = 50\nsteps = 4\n", {"--validation.steps=6"});
  EXPECT_EQ(c.validation.interval, 50);
  EXPECT_EQ(c.validation.steps, 6);
  EXPECT_FALSE(c == d);
  const std::string text = loom::to_toml(c);
  EXPECT_NE(text.find("[validation]\ninterval = 50\nsteps = 6\n"), std::string::npos) << text;
  EXPECT_EQ(parse(text), c);
  expect_error([] { parse("[validation]\ninterval = -1\n"); },
               {"job.toml:2", "validation.interval", "non-negative"});
  expect_error([] { parse("", {"--validation.steps=0"}); },
               {"command line", "validation.steps", "positive"});
  expect_error([] { parse("[validation]\nevery = 3\n"); }, {"validation.every", "interval"});
}

// [moe]: a mixture of experts' capacity factor, bias rate and warning threshold; 0 = dropless, off
// and the default. job_model_config puts them on the model's config (a bias rate gives the model
// its bias), and refuses them off their defaults for a model without experts.
TEST(JobConfig, MoeKeys) {
  const JobConfig d = parse("");
  EXPECT_EQ(d.moe.capacity_factor, 0);
  EXPECT_EQ(d.moe.bias_update_rate, 0);
  EXPECT_EQ(d.moe.load_warning, 0);
  JobConfig c =
      parse("[moe]\ncapacity_factor = 1.25\nbias_update_rate = 1e-3\n", {"--moe.load_warning=3"});
  EXPECT_EQ(c.moe.capacity_factor, 1.25);
  EXPECT_EQ(c.moe.bias_update_rate, 1e-3);
  EXPECT_EQ(c.moe.load_warning, 3);
  EXPECT_FALSE(c == d);
  const std::string text = loom::to_toml(c);
  EXPECT_NE(text.find("[moe]\ncapacity_factor = 1.25\nbias_update_rate = 0.001\nload_warning = 3"),
            std::string::npos)
      << text;
  EXPECT_EQ(parse(text), c);
  expect_error([] { parse("[moe]\ncapacity_factor = -0.5\n"); },
               {"job.toml:2", "moe.capacity_factor", ">= 0", "-0.5"});
  expect_error([] { parse("", {"--moe.bias_update_rate=-1"}); },
               {"command line", "moe.bias_update_rate", ">= 0"});
  expect_error([] { parse("", {"--moe.load_warning=1"}); }, {"moe.load_warning", "> 1"});

  const std::string moe = (fs::path(source_dir()) / "tests/parity/moe_debug.json").string();
  const loom::ModelConfig plain = loom::job_model_config(d, moe);
  EXPECT_FALSE(plain.moe("test").expert_bias);
  const loom::ModelConfig mc = loom::job_model_config(c, moe);
  EXPECT_EQ(mc.moe("test").training.capacity_factor, 1.25);
  EXPECT_EQ(mc.moe("test").training.bias_update_rate, 1e-3);
  EXPECT_EQ(mc.moe("test").load_warning_threshold(), 3);
  EXPECT_TRUE(mc.moe("test").expert_bias);
  EXPECT_EQ(mc.num_params(), plain.num_params() + 2 * 8);  // two sparse layers of 8 experts
  const std::string llama = (fs::path(source_dir()) / "configs/debug.json").string();
  expect_error([&] { loom::job_model_config(c, llama); },
               {"moe.capacity_factor = 1.25", "debug.json", "\"llama\"", "has no experts"});
  EXPECT_NO_THROW(loom::job_model_config(d, llama));
}

TEST(JobConfig, ProfilingTraceKey) {
  EXPECT_EQ(parse("").profiling.trace, "");  // off unless asked for
  JobConfig c = parse("[profiling]\ntrace = \"traces\"\n");
  EXPECT_EQ(c.profiling.trace, "traces");
  EXPECT_FALSE(c == parse(""));
  EXPECT_EQ(parse(loom::to_toml(c)), c);
  // An existing file cannot hold the per-rank files.
  const std::string file = ::testing::TempDir() + "/loom_trace_is_a_file";
  { std::ofstream(file) << "x"; }
  expect_error([&] { parse("", {"--profiling.trace=" + file}); },
               {"profiling.trace", "a directory", "an existing file"});
  expect_error([] { parse("[profiling]\ntrace = 3\n"); }, {"profiling.trace", "string"});
}

// metrics.tensorboard: unset, <job.dump_dir>/tensorboard wherever dump_dir came from (so
// --print-config and checkpoints show the directory); "" turns it off; an existing file is refused.
TEST(JobConfig, TensorboardDefaultsUnderDumpDir) {
  EXPECT_EQ(parse("").metrics.tensorboard, "runs/tensorboard");
  EXPECT_EQ(parse("[job]\ndump_dir = \"out/a\"\n").metrics.tensorboard, "out/a/tensorboard");
  EXPECT_EQ(parse("[job]\ndump_dir = \"out/a\"\n", {"--job.dump_dir=/x"}).metrics.tensorboard,
            "/x/tensorboard");
  EXPECT_EQ(parse("[metrics]\ntensorboard = \"\"\n", {"--job.dump_dir=/x"}).metrics.tensorboard,
            "");
  EXPECT_EQ(parse("", {"--metrics.tensorboard=tb"}).metrics.tensorboard, "tb");
  const JobConfig c = parse("[job]\ndump_dir = \"out/a\"\n");
  EXPECT_NE(loom::to_toml(c).find("tensorboard = \"out/a/tensorboard\""), std::string::npos);
  EXPECT_EQ(parse(loom::to_toml(c)), c);
  const std::string file = ::testing::TempDir() + "/loom_tensorboard_is_a_file";
  { std::ofstream(file) << "x"; }
  expect_error([&] { parse("", {"--metrics.tensorboard=" + file}); },
               {"metrics.tensorboard", "a directory", "an existing file"});
  expect_error([] { parse("[metrics]\ntensorboard = false\n"); },
               {"metrics.tensorboard", "string"});
}

// training.device: "auto" is resolved when parsed (with its reason in the TOML), "cuda" parses
// anywhere (a plan can be made for a GPU job) and fails at the start of a run where no GPU is
// usable, naming the key and what was found.
TEST(JobConfig, DeviceAutoResolvesAndCudaNeedsAGpu) {
  const loom::ops::GpuAvailability g = loom::ops::gpu_availability();
  loom::JobConfig c =
      parse("", {"--training.device=auto", "--training.mixed_precision_param=auto"});
  EXPECT_EQ(c.training.device, g.usable ? "cuda" : "cpu");
  EXPECT_NE(c.device_reason.find(g.usable ? "auto: GPU 0" : "auto: no GPU"), std::string::npos)
      << c.device_reason;
  EXPECT_NE(loom::to_toml(c).find("device = \"" + c.training.device + "\"  # auto:"),
            std::string::npos);
  if (g.usable) {
    EXPECT_EQ(c.training.mixed_precision_param, "bfloat16");
  }
  loom::JobConfig cuda = parse("[training]\ndevice = \"cuda\"\nallow_tf32 = true\n");
  EXPECT_EQ(cuda.training.device, "cuda");
  EXPECT_TRUE(cuda.training.allow_tf32);
  if (g.usable) {
    EXPECT_NO_THROW(loom::check_device_usable(cuda));
  } else {
    try {
      loom::check_device_usable(cuda);
      FAIL() << "device = cuda accepted without a GPU";
    } catch (const loom::Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("training.device = \"cuda\""), std::string::npos) << w;
      EXPECT_NE(w.find(g.why_not), std::string::npos) << w;
    }
  }
  EXPECT_THROW(parse("[training]\ndevice = \"tpu\"\n"), loom::Error);
}

// [checkpoint] verify (default true) and fallback (default false): parsed, written by to_toml,
// and fallback without verify refused (a corrupt checkpoint is found by verifying it).
TEST(JobConfig, CheckpointVerifyAndFallback) {
  const JobConfig d = parse("");
  EXPECT_TRUE(d.checkpoint.verify);
  EXPECT_FALSE(d.checkpoint.fallback);
  const JobConfig c = parse("[checkpoint]\nverify = false\n",
                            {"--checkpoint.verify=true", "--checkpoint.fallback=true"});
  EXPECT_TRUE(c.checkpoint.verify);
  EXPECT_TRUE(c.checkpoint.fallback);
  const std::string text = loom::to_toml(c);
  EXPECT_NE(text.find("verify = true\nfallback = true\n"), std::string::npos) << text;
  EXPECT_EQ(parse(text), c);
  EXPECT_FALSE(parse("", {"--checkpoint.verify=false"}).checkpoint.verify);
  expect_error(
      [] {
        parse("", {"--checkpoint.verify=false", "--checkpoint.fallback=true"});
      },
      {"checkpoint.fallback", "checkpoint.verify = false"});
}

// The pipeline's names become values where the options of parallelize are built
// (train/launch.cpp parallelize_options); parallel/ takes the values.
TEST(JobConfig, ParallelizeOptionsTakeThePipelineNamesAsValues) {
  const loom::ParallelizeOptions d = loom::parallelize_options(parse(""));
  EXPECT_EQ(d.pp_schedule, loom::pp::ScheduleKind::one_f_one_b);
  EXPECT_EQ(d.pp_fsdp_gather, loom::PpFsdpGather::microbatch);
  const loom::ParallelizeOptions o =
      loom::parallelize_options(parse("", {"--parallelism.pp=2", "--parallelism.pp_schedule=zbv",
                                           "--parallelism.pp_fsdp_gather=step"}));
  EXPECT_EQ(o.pp_schedule, loom::pp::ScheduleKind::zbv);
  EXPECT_EQ(o.pp_stages_per_rank, 2);  // the schedule's own
  EXPECT_EQ(o.pp_microbatches, 4);     // pp x stages per rank
  EXPECT_EQ(o.pp_fsdp_gather, loom::PpFsdpGather::step);
  EXPECT_TRUE(o.pp_schedule_csv.empty());
}
