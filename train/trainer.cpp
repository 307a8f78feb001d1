#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/trace.hpp"
#include "data/data_loader.hpp"
#include "data/token_shard.hpp"
#include "data/tokenizer.hpp"
#include "distributed/group_sum.hpp"
#include "distributed/mesh.hpp"
#include "model/model.hpp"
#include "model/safetensors.hpp"
#include "ops/devices.hpp"
#include "parallel/parallelize.hpp"
#include "train/checkpoint.hpp"
#include "train/checkpoint_convert.hpp"
#include "train/checkpoint_saver.hpp"
#include "train/launch.hpp"
#include "train/lr_schedule.hpp"
#include "train/metrics.hpp"
#include "train/optimizer.hpp"
#include "train/rank_plan.hpp"
#include "train/run_claim.hpp"
#include "train/step.hpp"
#include "train/tensorboard_writer.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string gib(size_t bytes) {
  char buf[32];
  const double g = double(bytes) / double(size_t(1) << 30);
  if (g >= 1024)
    std::snprintf(buf, sizeof buf, "%.2f TiB", g / 1024);
  else if (g >= 1)
    std::snprintf(buf, sizeof buf, "%.2f GiB", g);
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", g * 1024);
  return buf;
}

// The terminal's logger (rank 0; /dev/null elsewhere), when asked this rank's own file (where a
// lost terminal is noted too), and the TensorBoard files (world rank 0 alone: the others get no
// directory).
class RunLog {
 public:
  RunLog(const MetricsLogger::Options& term, FILE* rank_log,
         const TensorBoardWriter::Options& tensorboard)
      : term_(noting_in(term, rank_log)) {
    if (rank_log) file_.emplace(MetricsLogger::Options{rank_log, false, term.log_every, "", -1});
    if (!tensorboard.dir.empty()) tensorboard_.emplace(tensorboard);
  }
  void step(const StepMetrics& m) {
    term_.step(m);
    if (file_) file_->step(m);
    if (tensorboard_) tensorboard_->step(m);
  }
  void validation(int64_t step, double v) {
    term_.validation(step, v);
    if (file_) file_->validation(step, v);
    if (tensorboard_) tensorboard_->validation(step, v);
  }
  void message(const std::string& line) {
    term_.message(line);
    if (file_) file_->message(line);
  }
  void finish() {
    term_.finish();
    if (file_) file_->finish();
  }

 private:
  static MetricsLogger::Options noting_in(MetricsLogger::Options term, FILE* rank_log) {
    term.note_lost_out = rank_log;
    return term;
  }
  MetricsLogger term_;
  std::optional<MetricsLogger> file_;
  std::optional<TensorBoardWriter> tensorboard_;
};

// True on every rank when `flag` is true on any rank of `group` (an all-reduce sum of 0/1).
bool any_rank(dist::ProcessGroup& group, bool flag) {
  if (group.size() == 1) return flag;
  Tensor t = Tensor::empty({1}, DType::i32);
  t.data<int32_t>()[0] = flag ? 1 : 0;
  group.all_reduce(t, dist::ReduceOp::sum)->wait();
  return t.data<int32_t>()[0] > 0;
}

// The keys of the job config that change what a resumed run computes; the others (layout,
// logging, checkpointing) do not (docs/design.md decision 11: the layout does not change the math).
// local_batch_size and grad_accum_steps depend on the layout: the global batch is compared
// instead.
constexpr const char* kMathKeys[] = {
    "model.seed",  // also the data order's seed
    "moe.capacity_factor",
    "moe.bias_update_rate",
    "data.path",
    "data.shuffle",
    "training.seq_len",
    "training.max_norm",
    "training.mixed_precision_param",
    "training.mixed_precision_reduce",
    "optimizer.name",
    "optimizer.lr",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.weight_decay",
    "lr_scheduler.warmup_steps",
    "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_ratio",
    "lr_scheduler.decay_ratio",
};

// What differs between the checkpoint `dir` (state `st`) and this run in a way that changes
// the training math: "key: <checkpoint value> in the checkpoint, <value> now" lines.
std::vector<std::string> math_differences(const std::string& dir, const TrainState& st,
                                          const JobConfig& now, const ModelConfig& model_now,
                                          int64_t tokens_per_step) {
  std::vector<std::string> out;
  const std::string state_path = (fs::path(dir) / "state.json").string();
  const JobConfig then = parse_job_config(st.config_toml, state_path + " (config)");
  for (const ConfigDifference& d : config_differences(then, now))
    for (const char* k : kMathKeys)
      if (d.key == k)
        out.push_back(str_cat(d.key, " = ", d.a, " in the checkpoint, ", d.b, " now"));
  // More or fewer steps change the math only where the schedule spans them (not with
  // decay_type = none): the steps both runs would take after the checkpoint must keep their lr.
  if (then.training.steps != now.training.steps) {
    const LrSchedule a = LrSchedule::from_config(then), b = LrSchedule::from_config(now);
    for (int64_t k = st.step + 1; k <= std::min(then.training.steps, now.training.steps); ++k)
      if (a.at(k) != b.at(k)) {
        out.push_back(str_cat("training.steps = ", then.training.steps, " in the checkpoint, ",
                              now.training.steps, " now (the learning rate of step ", k,
                              " would be ", b.at(k), " instead of ", a.at(k), ")"));
        break;
      }
  }
  if (st.tokens_per_step > 0 && st.tokens_per_step != tokens_per_step)
    out.push_back(str_cat("tokens per step (local_batch_size x grad_accum_steps x seq_len x dp) = ",
                          st.tokens_per_step, " in the checkpoint, ", tokens_per_step, " now"));
  // The model: the checkpoint's config.json against the one this run reads (its path may move).
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  if (fs::is_regular_file(cfg_path)) {
    const auto a = nlohmann::json::parse(ModelConfig::from_file(cfg_path).to_json());
    const auto b = nlohmann::json::parse(model_now.to_json());
    for (const auto& [k, v] : b.items())
      if (!a.contains(k) || a[k] != v)
        out.push_back(str_cat("model config '", k, "' = ", a.contains(k) ? a[k].dump() : "absent",
                              " in the checkpoint, ", v.dump(), " now"));
  }
  return out;
}

// [profiling] trace: this rank's spans (steps, pipeline actions and waits), recorded while it
// lives (nothing without a directory) and written to DIR/rank-R.json by write().
class RankTrace {
 public:
  RankTrace(const std::string& dir, int rank) {
    if (dir.empty()) return;
    path_ = (fs::path(dir) / str_cat("rank-", rank, ".json")).string();
    std::error_code ec;
    fs::create_directories(dir, ec);
    LOOM_CHECK(fs::is_directory(dir), "profiling.trace = \"", dir,
               "\": cannot make the directory (", ec.message(), ")");
    recorder_ = std::make_unique<trace::Recorder>(rank);
    trace::set_recorder(recorder_.get());
  }
  ~RankTrace() { trace::set_recorder(nullptr); }
  RankTrace(const RankTrace&) = delete;
  RankTrace& operator=(const RankTrace&) = delete;
  // Returns the file written ("" without a trace).
  std::string write() const {
    if (recorder_) recorder_->write(path_);
    return path_;
  }

 private:
  std::string path_;
  std::unique_ptr<trace::Recorder> recorder_;
};

// A step's metrics: its result, then its time: tokens/s, the MFU against the job's measured GEMM
// peak (0: not measured) and the ETA.
class Progress {
 public:
  Progress(int64_t first_step, int64_t last_step, int64_t tokens_per_step, double flops_per_token,
           double job_gemm_peak)
      : first_step_(first_step),
        last_step_(last_step),
        tokens_per_step_(tokens_per_step),
        flops_per_token_(flops_per_token),
        job_gemm_peak_(job_gemm_peak) {}
  // What a step that made no update logs too.
  StepMetrics result(int64_t step, const StepResult& r, double lr, size_t peak_allocated) const {
    StepMetrics m;
    m.step = step;
    m.total_steps = last_step_;
    m.loss = r.loss;
    m.lr = lr;
    m.grad_norm = r.grad_norm;
    m.peak_allocated_bytes = peak_allocated;
    m.tokens_seen = step * tokens_per_step_;
    for (const ModelMetric& e : r.model_metrics) m.extra.push_back({e.name, e.label, e.value});
    return m;
  }
  void time(StepMetrics& m, double seconds, size_t peak_allocated) {
    m.step_seconds = seconds;
    m.tokens_per_s = double(tokens_per_step_) / m.step_seconds;
    m.mfu = job_gemm_peak_ > 0 ? flops_per_token_ * m.tokens_per_s / job_gemm_peak_ : 0;
    m.peak_allocated_bytes = peak_allocated;
    // The first step pays for allocations: the ETA is a moving average of the later ones.
    if (m.step <= first_step_ + 1)
      ema_step_s_ = m.step_seconds;
    else
      ema_step_s_ = 0.9 * ema_step_s_ + 0.1 * m.step_seconds;
    m.eta_seconds = ema_step_s_ * double(last_step_ - m.step);
  }

 private:
  int64_t first_step_, last_step_, tokens_per_step_;
  double flops_per_token_, job_gemm_peak_;
  double ema_step_s_ = 0;
};

struct FileCloser {
  void operator()(FILE* f) const {
    if (f) std::fclose(f);
  }
};

}  // namespace

namespace {

// The pre-flight's figures of a meta run: its peak, and the uses at the step's peak.
MemoryEstimate memory_estimate(const RankPlan& p, int64_t num_params) {
  MemoryEstimate m;
  m.params = size_t(num_params);
  const auto use = [&](MemoryUse u) { return p.at_peak[size_t(u)]; };
  m.states = use(MemoryUse::states);
  m.optimizer = use(MemoryUse::optimizer);
  m.activations = use(MemoryUse::work);
  m.workspace = use(MemoryUse::gathered) + use(MemoryUse::communication) + use(MemoryUse::loss);
  m.peak = p.run_peak_allocated;
  m.host = p.host;
  return m;
}

}  // namespace

MemoryEstimate estimate_training_memory(const JobConfig& job, const ModelConfig& c) {
  return memory_estimate(plan_rank({job, c}, 0), c.num_params());
}

size_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  size_t value = 0;
  while (f >> key >> value) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return value * 1024;  // the kernel reports kB
  }
  return 0;
}

struct Trainer::State {
  JobConfig job;
  TrainerOptions opt;
  dist::Mesh* mesh = nullptr;
  ParallelGroups groups;  // of the mesh (all nullptr: one process)
  bool writer = true;     // world rank 0: prints, writes metrics and checkpoints
  std::unique_ptr<FILE, FileCloser> devnull;
  std::optional<ModelConfig> mc_;  // set by read_config()
  const ModelConfig& mc() const { return *mc_; }
  std::string model_config_path;
  DType compute = DType::f32;
  int64_t B = 0, T = 0, G = 0;  // micro-batch, sequence, micro-batches per step
  MemoryEstimate mem;
  std::string tokenizer_json;
  std::unique_ptr<TokenStream> train, val;
  std::unique_ptr<DataLoader> loader;
  std::vector<MicroBatch> val_batches;
  std::string resume_dir;                // the checkpoint to resume from ("": none)
  std::unique_ptr<SafetensorsDir> init;  // model.init_from, when not resuming
  ParallelModel par;                     // the model and its parallel hooks
  std::unique_ptr<AdamW> adamw;
  LrSchedule schedule;
  int64_t step = 0;         // optimizer steps completed
  int64_t data_offset = 0;  // data loader step of optimizer step s (1-based) is s - 1 + offset
  std::string resumed_from;
  std::string config_note;           // the keys a resume changed (checkpoint.allow_config_change)
  std::vector<std::string> cleaned;  // what clean_checkpoint_dir did
  CheckpointDirLock dir_lock;        // world rank 0's, on checkpoint.dir, for the whole run
  std::vector<std::string> claim_notes;       // a stale lock taken over, little free space
  std::vector<std::string> checkpoint_notes;  // a corrupt one skipped, one without checksums
  std::string verify_stats;  // checkpoint_stats of the resume's verification ("": none)
  double last_loss = 0, last_lr = 0;
  std::string load_stats;       // checkpoint_stats of the resume's load ("" when not resuming)
  size_t peak_before_load = 0;  // the allocator's peak before the load reset it

  int64_t tokens_per_step() const { return G * B * T * groups.size; }

  // The constructor's phases, in order. Everything that can be wrong with the job is checked
  // before preflight() has passed and anything large is allocated.
  void build_mesh();       // the layout checked, the ranks' precision agreed, the groups
  void read_config();      // checkpoint keys, the model config, the step's shape
  void claim_outputs();    // checkpoint.dir locked, written to and its free space checked
  void preflight();        // the memory this rank needs against what it may use
  void build_data();       // shards, loaders, validation batches, tokenizer
  void find_checkpoint();  // what to resume from (or initialize from), checked against the job
  void build_model();      // parallelize(): the model of this rank, with its hooks
  void build_optimizer();
  void load_or_init();

  // The terminal's, the rank log's and the TensorBoard lines and the metrics file of run().
  RunLog run_log() const;
  // The GEMM peak for the MFU, measured and logged (0: not measured, on ranks other than 0).
  double gemm_peak(RunLog& log) const;
  // The run's first lines: the model, precision, device, data, memory estimate, what the
  // checkpoint directory held and what the resume loaded.
  std::vector<std::string> startup_lines() const;
  // [checkpoint]'s saves of this rank; `log` takes their lines.
  std::unique_ptr<CheckpointSaver> checkpoint_saver(std::function<void(const std::string&)> log);
  // A step whose loss or gradient norm is not finite ends the run, naming the last good
  // checkpoint.
  [[noreturn]] void fail_not_finite(int64_t at, const StepResult& r) const;
  // checkpoint.last_save_in_hf: `checkpoint` (of the last step) exported as DIR/hf-step-N, every
  // rank told whether it worked; returns that directory.
  std::string export_last_save_in_hf(const std::string& checkpoint);
};

Trainer::Trainer(const JobConfig& config, const TrainerOptions& options)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.job = config;
  // Parsing did these already, unless the caller built the struct.
  resolve_auto_device(s.job);
  resolve_auto_precision(s.job);
  s.opt = options;
  s.mesh = options.mesh;
  s.build_mesh();
  s.read_config();
  s.claim_outputs();
  s.preflight();
  s.build_data();
  s.find_checkpoint();
  s.build_model();
  s.build_optimizer();
  s.load_or_init();
}

void Trainer::State::build_mesh() {
  // Without a mesh one process is the whole world; with one, data, tensor and context
  // parallelism are supported (not pp).
  parallel_dims(job).validate(job.training.seq_len, mesh == nullptr);
  // "auto" was resolved on each rank's own CPU, but the ranks' GEMMs and FSDP's gathers share the
  // dtype: one rank without native bf16 matmuls makes every rank float32.
  if (mesh && !job.precision_reason.empty()) {
    std::string& p = job.training.mixed_precision_param;
    if (any_rank(mesh->world(), p != "bfloat16") && p == "bfloat16") {
      p = "float32";
      job.precision_reason =
          "auto: float32 on every rank, as some rank's CPU has no native bf16 matmul";
    }
  }
  groups = parallel_groups(mesh);
  if (mesh) {
    writer = mesh->world_rank() == 0;
    if (!writer) {
      devnull.reset(std::fopen("/dev/null", "w"));
      LOOM_CHECK(devnull != nullptr, "cannot open /dev/null");
      opt.out = devnull.get();
      opt.tty = false;
      opt.gemm_peak_seconds = 0;
    }
  }
}

void Trainer::State::read_config() {
  const JobConfig& j = job;
  LOOM_CHECK(j.checkpoint.interval == 0 || !j.checkpoint.dir.empty(),
             "checkpoint.interval = ", j.checkpoint.interval,
             " needs checkpoint.dir (where to save)");
  LOOM_CHECK(!j.checkpoint.resume || !j.checkpoint.dir.empty(),
             "checkpoint.resume = true needs checkpoint.dir (where to look for checkpoints)");

  model_config_path = resolve_model_config(j.model.config, j.base_dir);
  mc_ = job_model_config(j, model_config_path);
  const ModelConfig& mc = *mc_;
  mc.validate(model_config_path);
  // RoPE is defined for any position, but the model is not trained (and `loom generate` refuses
  // to run) beyond max_position_embeddings: refused here rather than after the training.
  LOOM_CHECK(j.training.seq_len <= mc.max_position_embeddings(),
             "training.seq_len = ", j.training.seq_len,
             " exceeds max_position_embeddings = ", mc.max_position_embeddings(), " of the model (",
             model_config_path, "): expected training.seq_len <= ", mc.max_position_embeddings());
  compute = dtype_from_name(j.training.mixed_precision_param);
  B = j.training.local_batch_size;
  T = j.training.seq_len;
  // With pp a step runs the schedule's micro-batches grad_accum_steps times.
  G = j.training.grad_accum_steps * pipeline_microbatches(j);
  schedule = LrSchedule::from_config(j);
}

void Trainer::State::claim_outputs() {
  // World rank 0 alone: it writes the directory's shared files and prunes; an error here ends
  // every rank. Before anything reads or cleans the directory, so a second run changes nothing.
  if (writer) check_tensorboard_dir_writable(job.metrics.tensorboard);
  if (!writer || job.checkpoint.dir.empty()) return;
  std::string note;
  dir_lock = CheckpointDirLock::acquire(job.checkpoint.dir, &note);
  if (!note.empty()) claim_notes.push_back(note);
  note.clear();
  // A checkpoint holds f32 weights and both AdamW moments of every parameter.
  check_checkpoint_dir_writable(job.checkpoint.dir, uint64_t(mc().num_params()) * 12,
                                job.checkpoint.keep, &note);
  if (!note.empty()) claim_notes.push_back(note);
}

void Trainer::State::preflight() {
  // This rank's step on the meta device (train/rank_plan.hpp, what `loom bench --check` and `loom
  // plan` report): nothing allocated. The states alone first, so a model whose parameters do not
  // fit is refused in a fraction of the time the step takes.
  size_t budget = opt.mem_available ? opt.mem_available : mem_available_bytes();
  std::string budget_what = opt.mem_available ? "the given budget" : "MemAvailable";
  // The device's memory and the offloaded states' host memory are the same RAM here; the device
  // pool alone is held to memory.limit_gb.
  bool count_host = true;
  if (job.memory.limit_gb > 0) {
    const size_t limit = size_t(job.memory.limit_gb * double(size_t(1) << 30));
    if (budget == 0 || limit < budget) {
      budget = limit;
      budget_what = "memory.limit_gb";
      count_host = false;
    }
  }
  PlanJob plan{job, mc(), mesh ? mesh->world_size() : 1, true};
  const int rank = mesh ? mesh->world_rank() : 0;
  for (const bool states_only : {true, false}) {
    plan.states_only = states_only;
    mem = memory_estimate(plan_rank(plan, rank), mc().num_params());
    const size_t needed = mem.total() + (count_host ? mem.host : 0);
    LOOM_CHECK(budget == 0 || needed <= budget, "not enough memory: training ", model_config_path,
               " needs about ", gib(needed), " on rank ", rank, " = ",
               mem.host
                   ? str_cat(mem.params, " parameters' states offloaded to host memory (",
                             gib(mem.host), count_host ? ", counted" : ", not in this sum", ") + ")
                   : std::string(),
               str_cat(mem.params, " parameters' weights and gradients ", gib(mem.states),
                       " + AdamW moments ", gib(mem.optimizer)),
               states_only ? " before any step"
                           : str_cat(" + activations ", gib(mem.activations), " (batch ", B,
                                     " x seq_len ", T, ") + working buffers ", gib(mem.workspace)),
               ", but ", budget_what, " is ", gib(budget));
  }
}

void Trainer::State::build_data() {
  const JobConfig& j = job;
  LOOM_CHECK(!j.data.path.empty(),
             "data.path is empty: expected a directory of token shards from `loom tokenize`");
  LOOM_CHECK(fs::is_directory(j.data.path), "data.path '", j.data.path,
             "' is not a directory (expected the output directory of `loom tokenize`; a relative ",
             "path is taken from the current directory)");
  train = std::make_unique<TokenStream>(j.data.path, "train");
  // A shard vocabulary smaller than the model's is fine (the model's embedding table is padded,
  // ids stay in range); a larger one would index past the embedding.
  auto check_vocab = [&](const TokenStream& ts, const char* split) {
    LOOM_CHECK(int64_t(ts.vocab_size()) <= mc().vocab_size(), "data.path '", j.data.path, "': the ",
               split, " shards have vocab_size ", ts.vocab_size(), " but the model (",
               model_config_path, ") has vocab_size ", mc().vocab_size(),
               ": token ids would index past the embedding (expected shard vocab_size <= ",
               mc().vocab_size(), ")");
  };
  check_vocab(*train, "train");
  // A sample is seq_len + 1 tokens (inputs and targets shifted by one); a shorter split would
  // train on the same few tokens, wrapped around, every step.
  auto check_length = [&](const TokenStream& ts, const char* split) {
    LOOM_CHECK(ts.size() >= uint64_t(T) + 1, "data.path '", j.data.path, "': the ", split,
               " shards hold ", ts.size(),
               " tokens, fewer than one sample of training.seq_len + 1 = ", T + 1,
               " tokens (tokenize more text, or lower training.seq_len)");
  };
  check_length(*train, "train");
  DataLoaderConfig dl;
  dl.local_batch_size = B;
  dl.seq_len = T;
  dl.grad_accum_steps = G;
  dl.dp_rank = groups.rank;
  dl.dp_size = groups.size;
  dl.shuffle = j.data.shuffle;
  dl.seed = uint64_t(j.model.seed);
  loader = std::make_unique<DataLoader>(*train, dl);
  if (j.validation.interval > 0) {
    LOOM_CHECK(!TokenStream::find_files(j.data.path, "val").empty(),
               "validation.interval = ", j.validation.interval, " but data.path '", j.data.path,
               "' has no val-*.bin shards (tokenize with --val-fraction, or set ",
               "--validation.interval=0)");
    val = std::make_unique<TokenStream>(j.data.path, "val");
    check_vocab(*val, "val");
    check_length(*val, "val");
    DataLoaderConfig vl = dl;
    vl.grad_accum_steps = 1;
    vl.shuffle = false;
    const DataLoader val_loader(*val, vl);
    for (int64_t b = 0; b < j.validation.steps; ++b) val_batches.push_back(val_loader.get(b, 0));
  }
  if (!j.data.tokenizer.empty()) {
    LOOM_CHECK(fs::is_regular_file(j.data.tokenizer), "data.tokenizer '", j.data.tokenizer,
               "' is not a file");
    tokenizer_json = j.data.tokenizer;
  } else if (fs::is_regular_file(fs::path(j.data.path) / "tokenizer.json")) {
    tokenizer_json = (fs::path(j.data.path) / "tokenizer.json").string();
  }
  // It is copied into every checkpoint for `loom generate`: a broken file must stop the run now,
  // not fail the first generate after the training.
  if (writer && !tokenizer_json.empty() && !j.checkpoint.dir.empty()) {
    try {
      (void)Tokenizer::load(tokenizer_json);
    } catch (const Error& e) {
      fail(
          "the tokenizer '", tokenizer_json, "' (",
          j.data.tokenizer.empty() ? "found in data.path" : "data.tokenizer",
          "), which every checkpoint carries for `loom generate`, cannot be read: ", e.what(),
          "\n(expected the tokenizer.json that `loom tokenize` wrote; set data.tokenizer to a good "
          "copy)");
    }
  }
}

void Trainer::State::find_checkpoint() {
  const JobConfig& j = job;
  // What interrupted saves and prunes left behind goes first (world rank 0 alone writes the
  // directory; the others wait for it so they all see the same checkpoints).
  if (writer) cleaned = clean_checkpoint_dir(j.checkpoint.dir);
  if (mesh) any_rank(mesh->world(), false);
  if (j.checkpoint.resume) {
    // Verified before anything is built, the ranks sharing the reads and taking one decision.
    const auto t0 = Clock::now();
    ResumeChoice c =
        choose_resume_checkpoint(j.checkpoint.dir, j.checkpoint.verify, j.checkpoint.fallback,
                                 mesh ? &mesh->world() : nullptr);
    if (j.checkpoint.verify && !c.dir.empty())
      verify_stats =
          checkpoint_stats("verify", mesh ? mesh->world_rank() : 0, seconds_since(t0), 0, 0, 0, 0);
    resume_dir = c.dir;
    checkpoint_notes = std::move(c.notes);
  }
  if (!j.checkpoint.resume && !j.checkpoint.dir.empty()) {
    // A fresh run's saves would replace those checkpoints, or be pruned at once in favour of
    // their higher steps, and a later resume would continue the other run: refused before any
    // work is done.
    const std::string old = latest_checkpoint(j.checkpoint.dir);
    LOOM_CHECK(old.empty(), "checkpoint.dir '", j.checkpoint.dir,
               "' already holds checkpoints of another run (the latest is ", old,
               "): this run would overwrite them or be pruned in their favour. Continue that run "
               "with --checkpoint.resume=true, or give this one another checkpoint.dir");
  }
  if (!resume_dir.empty()) {
    const TrainState st = read_checkpoint_state(resume_dir);
    const std::vector<std::string> diff =
        math_differences(resume_dir, st, j, mc(), tokens_per_step());
    std::string list;
    for (const std::string& d : diff) list += "\n  " + d;
    LOOM_CHECK(diff.empty() || j.checkpoint.allow_config_change, "resuming from ", resume_dir,
               ": the configuration differs from the checkpoint's in keys that change the "
               "training math:",
               list,
               "\nrun with the checkpoint's values, or set --checkpoint.allow_config_change=true "
               "to continue with the new ones");
    if (!diff.empty()) config_note = "  note: continuing with a changed configuration:" + list;
  }
  // A fresh run would truncate the history another run wrote there (a resume appends to it).
  if (writer && resume_dir.empty()) check_metrics_file_free(j.metrics.jsonl, j.metrics.overwrite);
  if (writer && resume_dir.empty())
    check_tensorboard_dir_free(j.metrics.tensorboard, j.metrics.overwrite);
  if (resume_dir.empty() && !j.model.init_from.empty()) {
    // init_from may be a loom checkpoint: verified as a resume's (a Hugging Face one has no
    // checksums and is left alone).
    if (j.checkpoint.verify) {
      const std::string note =
          verify_checkpoint(j.model.init_from, mesh ? &mesh->world() : nullptr);
      if (!note.empty()) checkpoint_notes.push_back(note);
    }
    init = std::make_unique<SafetensorsDir>(j.model.init_from);
  }
}

void Trainer::State::build_model() {
  if (job.memory.limit_gb > 0)
    Allocator::get(parallelize_options(job).device)
        .set_limit(size_t(job.memory.limit_gb * double(size_t(1) << 30)));
  par = parallelize(mc(), compute, groups, parallelize_options(job));
}

void Trainer::State::build_optimizer() {
  const auto& o = job.optimizer;
  AdamWConfig oc{float(o.lr), float(o.beta1), float(o.beta2), float(o.eps), float(o.weight_decay)};
  adamw = std::make_unique<AdamW>(par.model->units(), oc);
}

void Trainer::State::load_or_init() {
  if (!resume_dir.empty()) {
    auto& alloc = Allocator::get(parallelize_options(job).device);
    peak_before_load = alloc.stats().peak_allocated;
    const size_t held = alloc.stats().allocated;
    alloc.reset_peak();
    const auto t0 = Clock::now();
    // Verified already (find_checkpoint), with the reads shared among the ranks.
    const TrainState st =
        load_checkpoint(resume_dir, *par.model, *adamw,
                        par.pipeline ? par.pipeline->used_units() : std::vector<size_t>{}, false);
    load_stats = checkpoint_stats("load", mesh ? mesh->world_rank() : 0, seconds_since(t0), held,
                                  checkpoint_shard_bytes(*par.model, *adamw),
                                  alloc.stats().peak_allocated, 0);
    step = st.step;
    data_offset = st.data_step - st.step;
    last_loss = st.loss;
    last_lr = st.lr;
    resumed_from = resume_dir;
  } else if (init) {
    par.model->load_hf(*init);
    init.reset();
  } else {
    par.model->init_weights(uint64_t(job.model.seed));
  }
}

Trainer::~Trainer() = default;

Model& Trainer::model() {
  return *s_->par.model;
}
AdamW& Trainer::optimizer() {
  return *s_->adamw;
}
int64_t Trainer::step() const {
  return s_->step;
}

double Trainer::validate() {
  State& s = *s_;
  LOOM_CHECK(!s.val_batches.empty(), "validate: no validation batches (validation.interval = 0)");
  double sum = s.par.validation_loss(int64_t(s.val_batches.size()), [&](int64_t j) {
    const MicroBatch& mb = s.val_batches[size_t(j)];
    return MicroBatchView{mb.inputs.data(), mb.targets.data(), mb.B, mb.T};
  });
  sum = group_sum(s.groups.dp, sum);
  return sum / double(int64_t(s.val_batches.size()) * s.B * s.T * s.groups.size);
}

RunLog Trainer::State::run_log() const {
  const JobConfig& j = job;
  // A run with nothing left to train starts no event file.
  return RunLog({opt.out, opt.tty, j.metrics.log_every, writer ? j.metrics.jsonl : std::string(),
                 resumed_from.empty() ? -1 : step},
                opt.rank_log,
                {writer && step < j.training.steps ? j.metrics.tensorboard : std::string(),
                 resumed_from.empty() ? -1 : step, to_toml(j)});
}

double Trainer::State::gemm_peak(RunLog& log) const {
  if (!(opt.gemm_peak_seconds > 0)) return 0;
  const double peak =
      ops::measure_gemm_peak(parallelize_options(job).device, compute, opt.gemm_peak_seconds);
  log.message(str_cat("  GEMM peak ", std::llround(peak / 1e9), " GFLOP/s (", dtype_name(compute),
                      ", measured for MFU)"));
  return peak;
}

std::vector<std::string> Trainer::State::startup_lines() const {
  const JobConfig& j = job;
  std::vector<std::string> out;
  std::ostringstream os;
  os << "loom train: " << model_config_path << ": " << mem.params << " parameters ("
     << par.model->describe() << "), " << dtype_name(compute) << " GEMMs";
  out.push_back(os.str());
  out.push_back("  precision " + describe_precision(j));
  if (j.training.device != "cpu" || !j.device_reason.empty())
    out.push_back(str_cat("  device ", j.training.device,
                          j.device_reason.empty() ? "" : " (" + j.device_reason + ")"));
  os.str("");
  os << "  data " << j.data.path << ": " << train->size() << " train tokens";
  if (val) os << ", " << val->size() << " val tokens";
  if (int64_t(train->vocab_size()) < mc().vocab_size())
    os << " (shard vocab " << train->vocab_size() << " < model vocab " << mc().vocab_size() << ")";
  os << "; " << j.training.steps << " steps of " << G << " x " << B << " x " << T;
  if (mesh)
    os << " x dp " << groups.size << " (" << mesh->layout().describe() << ", " << par.kind() << ")";
  os << " = " << tokens_per_step() << " tokens";
  out.push_back(os.str());
  out.push_back(str_cat("  memory estimate ", gib(mem.total()),
                        " (the step on the meta device, at its peak: weights+grads ",
                        gib(mem.states), ", AdamW ", gib(mem.optimizer), ", activations ",
                        gib(mem.activations), ", working buffers ", gib(mem.workspace), ")"));
  if (mem.host)
    out.push_back(str_cat("  CPU offload: master weights, gradient shards and AdamW moments in ",
                          "host memory, ", gib(mem.host),
                          " (stepped there; the device holds units only while gathered)"));
  if (!resumed_from.empty())
    out.push_back(str_cat("  resumed from ", resumed_from, " (step ", step, ")"));
  else if (j.checkpoint.resume)
    out.push_back(str_cat("  no checkpoint in '", j.checkpoint.dir, "': starting from step 0"));
  if (!config_note.empty()) out.push_back(config_note);
  for (const std::string& n : checkpoint_notes) out.push_back("  " + n);
  for (const std::string& c : cleaned) out.push_back(str_cat("  checkpoint.dir: ", c));
  for (const std::string& n : claim_notes) out.push_back(n);
  if (!verify_stats.empty()) out.push_back("  " + verify_stats);
  if (!load_stats.empty()) out.push_back("  " + load_stats);
  return out;
}

std::unique_ptr<CheckpointSaver> Trainer::State::checkpoint_saver(
    std::function<void(const std::string&)> log) {
  CheckpointSaver::Options o;
  o.dir = job.checkpoint.dir;
  o.keep = job.checkpoint.keep;
  o.async = job.checkpoint.async;
  o.prunes = writer;
  o.rank = mesh ? mesh->world_rank() : 0;
  o.each_size = gib(size_t(mem.params) * 12);  // f32 weights + 2 moments
  o.tokenizer_json = tokenizer_json;
  // Under pp each rank writes only its stages' units, the only ones it keeps up to date.
  o.comm = {groups.shard, mesh ? &mesh->world() : nullptr, groups.tp,
            par.pipeline ? par.pipeline->owned_units() : std::vector<size_t>{}};
  o.run_peak = peak_before_load;
  return std::make_unique<CheckpointSaver>(std::move(o), *par.model, *adamw,
                                           Allocator::get(parallelize_options(job).device),
                                           std::move(log));
}

std::string Trainer::State::export_last_save_in_hf(const std::string& checkpoint) {
  // World rank 0 alone reads the checkpoint (streaming, one tensor at a time); every rank learns
  // whether it worked.
  const std::string hf = (fs::path(job.checkpoint.dir) / ("hf-" + checkpoint_name(step))).string();
  std::string error;
  if (writer) {
    try {
      std::error_code ec;
      fs::remove_all(hf, ec);  // an export of this step by an earlier run of it
      export_hugging_face(checkpoint, hf, {.verify = job.checkpoint.verify});
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (mesh && any_rank(mesh->world(), !error.empty()) && error.empty())
    fail(
        "checkpoint.last_save_in_hf: the export on world rank 0 failed (its message names the "
        "cause)");
  LOOM_CHECK(error.empty(), "checkpoint.last_save_in_hf: ", error);
  return hf;
}

void Trainer::State::fail_not_finite(int64_t at, const StepResult& r) const {
  const std::string good =
      job.checkpoint.dir.empty() ? std::string() : latest_checkpoint(job.checkpoint.dir);
  fail("step ", at, ": the loss is ", r.loss, " and the gradient norm ", r.grad_norm,
       "; stopping without an update and without saving this state",
       good.empty() ? std::string() : str_cat(" (the last good checkpoint is ", good, ")"),
       " (a lower optimizer.lr may help)");
}

TrainResult Trainer::run() {
  State& s = *s_;
  const JobConfig& j = s.job;
  const int64_t N = j.training.steps;
  const int64_t tokens_per_step = s.tokens_per_step();
  TrainResult result;
  result.final_step = s.step;

  RunLog log = s.run_log();
  for (const std::string& line : s.startup_lines()) log.message(line);
  const double peak = s.gemm_peak(log);
  if (s.step >= N) {
    log.message(str_cat("already at step ", s.step, " of ", N, ": nothing to train"));
    return result;
  }

  const auto saver = s.checkpoint_saver([&log](const std::string& line) { log.message(line); });
  const RankTrace trace(j.profiling.trace, s.mesh ? s.mesh->world_rank() : 0);
  // The peak is one process's: the job's is world size times that.
  Progress progress(s.step + 1, N, tokens_per_step, s.mc().flops_per_token(s.T),
                    peak * double(s.mesh ? s.mesh->world_size() : 1));
  TrainStep train_step(s.par, *s.adamw, j.training.max_norm, tokens_per_step);
  for (int64_t step = s.step + 1; step <= N; ++step) {
    const auto t0 = Clock::now();
    MicroBatch mb;
    const double lr = s.schedule.at(step);
    trace::Span step_span("step", str_cat("step ", step));
    step_span.arg("step", step);
    const StepResult r = train_step.run(
        s.G,
        [&](int64_t micro) -> const MicroBatch& {
          return mb = s.loader->get(step - 1 + s.data_offset, micro);
        },
        lr, [&] { saver->before_update(); });
    step_span.end();

    StepMetrics m = progress.result(step, r, lr, saver->peak_allocated());
    if (!r.updated) {
      log.step(m);
      s.fail_not_finite(step, r);
    }
    s.step = step;
    s.last_loss = r.loss;
    s.last_lr = lr;
    result.steps.push_back({step, r.loss, lr, r.grad_norm});
    result.final_step = step;

    progress.time(m, seconds_since(t0), saver->peak_allocated());
    log.step(m);
    for (const std::string& note : r.notes) log.message(str_cat("step ", step, ": ", note));

    if (j.validation.interval > 0 && (step % j.validation.interval == 0 || step == N)) {
      const double v = validate();
      result.val_losses.emplace_back(step, v);
      log.validation(step, v);
    }
    bool stop = s.opt.stop && s.opt.stop->load(std::memory_order_relaxed);
    // A signal may reach some ranks only (or reach them in different steps): the ranks agree,
    // so all of them stop after the same step and take part in the same save.
    if (s.mesh) stop = any_rank(s.mesh->world(), stop);
    if ((j.checkpoint.interval > 0 && step % j.checkpoint.interval == 0) || step == N || stop)
      saver->save(
          {step, step + s.data_offset, s.last_lr, s.last_loss, to_toml(j), tokens_per_step});
    if (stop && step < N) {
      result.interrupted = true;
      log.message(str_cat("interrupted: stopped after step ", step, " of ", N,
                          j.checkpoint.dir.empty() ? " (no checkpoint.dir: nothing saved)" : ""));
      break;
    }
  }
  saver->finish();
  result.last_checkpoint = saver->last_checkpoint();
  if (const std::string path = trace.write(); !path.empty()) log.message("trace: " + path);
  if (j.checkpoint.last_save_in_hf && !result.last_checkpoint.empty() &&
      saver->last_saved() == s.step) {
    const std::string hf = s.export_last_save_in_hf(result.last_checkpoint);
    log.message(str_cat("exported ", result.last_checkpoint, " as Hugging Face directory ", hf));
  }
  log.finish();
  return result;
}

}  // namespace loom
