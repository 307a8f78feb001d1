#pragma once
// The job configuration: a TOML file plus `--section.key=value` command-line overrides, resolved
// into a typed struct. Every key has a default. Unknown sections or keys, wrong types and
// out-of-range values are errors naming the key (`training.seq_len`) and where its value came
// from (the file, or "command line").
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace loom {

struct JobConfig {
  struct Job {
    std::string name = "loom";
    std::string dump_dir = "runs";
    // Multi-process runs: every rank also writes its progress lines and errors to
    // <dump_dir>/logs/rank-<world rank>.log (rank 0 still prints to the terminal).
    bool rank_logs = false;
    // Multi-process runs: seconds a rank waits in one collective before it names the collective,
    // mesh dim and peers and ends the job (distributed/mpi_process_group.hpp).
    double collective_timeout_s = 300;
    bool operator==(const Job&) const = default;
  } job;
  struct Model {
    std::string config;     // a config.json path or a name from configs/ (resolve_model_config)
    std::string init_from;  // a Hugging Face directory to load weights from ("" = seeded init)
    int64_t seed = 1234;
    bool operator==(const Model&) const = default;
  } model;
  // A mixture of experts' training options (model/moe_config.hpp MoeConfig::Training; an error
  // for other models unless at their defaults).
  struct Moe {
    // Each expert computes at most ceil(tokens x k / E x capacity_factor) of a micro-batch's
    // choices, the first in token order; the rest are dropped (the `dropped` metric). 0: dropless.
    double capacity_factor = 0;
    // DeepSeek-V3's auxiliary-loss-free balancing: a selection-only bias per sparse layer, moved
    // by this much toward the mean load after each optimizer step (b_e += rate x sign(mean -
    // load_e)). 0: off (a bias the model already has stays as it is).
    double bias_update_rate = 0;
    // A sparse layer whose load max/mean over a step reaches this is reported in the log (a
    // router running away); 0: halfway between balanced and every token to one expert,
    // (1 + E/k) / 2.
    double load_warning = 0;
    bool operator==(const Moe&) const = default;
  } moe;
  struct Data {
    std::string path;  // directory of token shards
    std::string tokenizer;
    bool shuffle = false;
    bool operator==(const Data&) const = default;
  } data;
  struct Training {
    // cpu | cuda | auto: where the step runs. auto takes the GPU where this loom has the CUDA
    // backend and a GPU is usable, else the CPU, and is resolved when parsed (--print-config and
    // checkpoints show the device; device_reason says why). cuda with no usable GPU is an error
    // naming this key when the run starts. Rank r uses GPU (local rank mod GPUs).
    std::string device = "cpu";
    // float32 GEMMs on a GPU in TF32 (about 8x the float32 rate, ~1e-3 relative error); false:
    // exact float32.
    bool allow_tf32 = false;
    int64_t steps = 100;
    int64_t local_batch_size = 8;
    int64_t seq_len = 256;
    int64_t grad_accum_steps = 1;
    double max_norm = 1.0;
    // float32 | bfloat16 | auto: bfloat16 where oneDNN has native bf16 matmuls (AVX512_BF16,
    // AMX), float32 elsewhere (bf16 GEMMs would be widened to f32 there: slower than float32).
    // Parsing resolves auto to the concrete dtype (what --print-config and checkpoints show).
    std::string mixed_precision_param = "float32";
    std::string mixed_precision_reduce = "float32";  // float32 | bfloat16
    // FSDP's master weights, gradient shards and AdamW moments in host memory, stepped there
    // (docs/design.md decision 4); needs dp_shard x cp > 1.
    bool enable_cpu_offload = false;
    bool operator==(const Training&) const = default;
  } training;
  struct Optimizer {
    std::string name = "adamw";  // adamw
    double lr = 3e-4;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
    bool operator==(const Optimizer&) const = default;
  } optimizer;
  struct LrScheduler {
    int64_t warmup_steps = 0;
    std::string decay_type = "cosine";  // cosine | linear | wsd | none
    double min_lr_ratio = 0.1;          // the final lr as a fraction of lr
    double decay_ratio = 0.1;           // wsd: the fraction of the steps spent decaying
    bool operator==(const LrScheduler&) const = default;
  } lr_scheduler;
  struct Validation {
    int64_t interval = 0;  // steps between validations on the `val` split; 0 = never
    int64_t steps = 10;    // batches of local_batch_size x seq_len per validation (a fixed set)
    bool operator==(const Validation&) const = default;
  } validation;
  struct Parallelism {
    int64_t dp_replicate = 1;
    int64_t dp_shard = -1;  // -1: whatever the other dims leave of the world size
    int64_t tp = 1;
    int64_t cp = 1;
    int64_t pp = 1;
    // Expert parallelism (mixture of experts): the experts split over ep ranks borrowed from
    // dp_shard x cp (distributed/mesh.hpp add_expert_groups).
    int64_t ep = 1;
    std::string fsdp_reshard_after_forward = "default";  // default | always | never
    bool tp_sequence_parallel = true;
    bool tp_recompute_allgather = false;
    bool tp_async = false;  // overlap SP's forward all-gathers with the local rows' GEMM
    std::string cp_rotate_method = "p2p";  // p2p | allgather
    std::string pp_schedule = "1f1b";      // gpipe | 1f1b | interleaved_1f1b | zb1p | zbv
    // Micro-batches (of local_batch_size each) one run of the schedule takes; 0: pp x the stages
    // per rank. A step runs the schedule grad_accum_steps times.
    int64_t pp_microbatches = 0;
    int64_t pp_stages_per_rank = 0;  // 0: the schedule's (2 for interleaved_1f1b and zbv, else 1)
    std::string pp_stage_layers;     // "4,5,5,4": layers per stage; empty: balanced
    std::string pp_schedule_csv;     // a schedule as torchtitan's compute-only CSV (overrides)
    std::string pp_fsdp_gather = "microbatch";  // microbatch | step (parallel/pipeline_fsdp.hpp)
    bool operator==(const Parallelism&) const = default;
  } parallelism;
  struct ActivationCheckpoint {
    std::string mode = "none";            // none | full | selective
    std::string selective_option = "op";  // "op", or N: every N-th block fully checkpointed
    bool operator==(const ActivationCheckpoint&) const = default;
  } activation_checkpoint;
  struct Checkpoint {
    std::string dir;
    int64_t interval = 0;  // steps between saves; 0 = never
    int64_t keep = 3;      // how many recent checkpoints to keep; 0 = all
    bool resume = false;
    // A resume whose configuration differs from the checkpoint's in a key that changes the
    // training math (optimizer, schedule, batch, data, model) is refused unless this is true.
    bool allow_config_change = false;
    // At the end of training the last checkpoint is also written as a Hugging Face directory,
    // DIR/hf-step-<N> (f32), by `loom convert`'s code.
    bool last_save_in_hf = false;
    // Saves copy the shards to a staging buffer and a background thread writes them; the next
    // save and the end of training wait for it.
    bool async = false;
    // A resume (and an export, and init_from of a loom checkpoint) checks every file against
    // the checksums the checkpoint recorded when it was saved; false reads them unchecked.
    bool verify = true;
    // A resume whose latest checkpoint is corrupt (verify) skips it, with a note, for the
    // previous complete one; false stops with an error naming that one.
    bool fallback = false;
    bool operator==(const Checkpoint&) const = default;
  } checkpoint;
  struct Metrics {
    std::string jsonl;  // "" = no JSONL file
    int64_t log_every = 1;
    // A fresh run (nothing resumed) refuses a non-empty `jsonl` of another run unless this is true;
    // a resumed run appends after its checkpoint's step either way.
    bool overwrite = false;
    // TensorBoard event files (train/tensorboard_writer.hpp) in this directory; "" = none. Unset:
    // <job.dump_dir>/tensorboard, resolved when parsed (so --job.dump_dir moves it). A fresh run
    // refuses another run's event files there unless `overwrite`; a resume appends.
    std::string tensorboard = "runs/tensorboard";
    bool operator==(const Metrics&) const = default;
  } metrics;
  struct Profiling {
    // "" = off; else each rank writes DIR/rank-R.json (R its world rank): a Chrome trace (opens in
    // Perfetto) of every step with a span per pipeline action and wait, each with its CPU time.
    std::string trace;
    bool operator==(const Profiling&) const = default;
  } profiling;
  struct Bench {
    int64_t warmup_steps = 2;
    int64_t steps = 5;
    bool operator==(const Bench&) const = default;
  } bench;
  struct Memory {
    double limit_gb = 0;  // 0 = no limit
    bool operator==(const Memory&) const = default;
  } memory;

  // Not a key: the directory of the TOML file ("." for a bare file name, "" when parsed from
  // text), against which relative paths such as model.config are resolved.
  std::string base_dir;
  // Not a key: why training.mixed_precision_param has its value when it was "auto" (for the
  // startup lines), e.g. "auto: oneDNN avx512_core_bf16 has native bf16 matmuls"; "" when set.
  std::string precision_reason;
  // Not a key: why training.device has its value when it was "auto", e.g. "auto: GPU 0 NVIDIA
  // H100 80GB HBM3" or "auto: no GPU (no NVIDIA driver ...)"; "" when set.
  std::string device_reason;

  // Compares the keys (base_dir is where the file was, not part of the configuration).
  bool operator==(const JobConfig& o) const;
};

// Reads a TOML file, then applies `overrides` (`--section.key=value`, in order, later ones win).
JobConfig load_job_config(const std::string& toml_path, const std::vector<std::string>& overrides);
// The same from TOML text; `source` names it in error messages.
JobConfig parse_job_config(const std::string& toml_text, const std::string& source,
                           const std::vector<std::string>& overrides = {});
// Replaces training.mixed_precision_param = "auto" by the dtype this machine runs fastest
// (bfloat16 where cpu::cpu_isa().onednn_native_bf16 and the bf16 GEMMs run natively, else
// float32) and sets precision_reason. parse_job_config calls it; a no-op when already concrete.
void resolve_auto_precision(JobConfig& c);
// Replaces training.device = "auto" by "cuda" where a GPU is usable (ops::gpu_availability), else
// "cpu", and sets device_reason; on cuda, mixed_precision_param = "auto" becomes bfloat16 (the
// GPU's tensor cores). parse_job_config calls it before resolve_auto_precision.
void resolve_auto_device(JobConfig& c);
// Where the run's device is cuda, checks that a GPU is usable, naming the key and what was found.
void check_device_usable(const JobConfig& c);
// One line for the startup output: the compute precision, why, and how its GEMMs run, e.g.
// "bfloat16 (auto: oneDNN avx512_core_bf16 has native bf16 matmuls); bf16 GEMMs native (...)".
std::string describe_precision(const JobConfig& c);
// The resolved configuration as TOML, every key written (for --print-config); parsing it gives
// back the same configuration.
std::string to_toml(const JobConfig& c);

// One key whose value differs between two configurations, with both values as TOML text.
struct ConfigDifference {
  std::string key;  // "optimizer.lr"
  std::string a, b;
};
// The keys whose values differ, in to_toml's order.
std::vector<ConfigDifference> config_differences(const JobConfig& a, const JobConfig& b);

// Finds the model config.json named by [model] config: a path (absolute, or relative to the TOML
// file's directory or the current directory), or a bare NAME meaning configs/NAME.json, searched
// in <toml_dir>/../configs, ./configs, $LOOM_SOURCE_DIR/configs, <exe dir>/../configs and
// <exe dir>/../share/loom/configs. Returns an absolute path; the error lists every place tried.
std::string resolve_model_config(const std::string& value, const std::string& toml_dir);
// configs/FILE (FILE relative, e.g. "hardware/h200.toml") in the places above; `what` names it
// in the error.
std::string find_in_configs(const std::string& file, const std::string& toml_dir,
                            const std::string& what);
// The first of `tried` that is a file, as an absolute path; the error lists them all.
std::string first_file(const std::vector<std::filesystem::path>& tried, const std::string& what);

}  // namespace loom
