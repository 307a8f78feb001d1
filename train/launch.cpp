#include "train/launch.hpp"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "ops/devices.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/schedule_csv.hpp"
#include "parallel/pipeline_fsdp.hpp"

namespace loom {

namespace {

// 64-bit FNV-1a: a fingerprint to compare, not a defence against forgery.
uint64_t fnv1a(std::string_view bytes, uint64_t h = 14695981039346656037ull) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The binary this process runs, as its version: ranks started from different builds (an
// MPMD launch, a stale copy on one host) would compute different things.
uint64_t binary_fingerprint() {
  std::ifstream f("/proc/self/exe", std::ios::binary);
  uint64_t h = fnv1a("");
  std::vector<char> buf(size_t(1) << 20);
  while (f.read(buf.data(), std::streamsize(buf.size())) || f.gcount() > 0)
    h = fnv1a(std::string_view(buf.data(), size_t(f.gcount())), h);
  return h;
}

// `text` of rank `root`, on every rank of `world`.
std::string broadcast_text(dist::ProcessGroup& world, const std::string& text, int root) {
  Tensor len = Tensor::empty({1}, DType::i32);
  len.data<int32_t>()[0] = int32_t(text.size());
  world.broadcast(len, root)->wait();
  const size_t n = size_t(len.data<int32_t>()[0]);
  Tensor words = Tensor::empty({int64_t((n + 3) / 4) + 1}, DType::i32);
  if (world.rank() == root) std::memcpy(words.raw(), text.data(), n);
  world.broadcast(words, root)->wait();
  return std::string(static_cast<const char*>(words.raw()), n);
}

// Every rank compares a fingerprint of its resolved configuration and of its binary with the
// others' before the mesh is built, so that ranks launched with different settings (another
// optimizer.lr, another training.steps) refuse at once, naming the keys, instead of training
// with a mix of them or waiting in a collective that a peer never calls.
void check_ranks_agree(dist::ProcessGroup& world, const JobConfig& job) {
  const std::string toml = to_toml(job);
  const uint64_t mine[2] = {fnv1a(toml), binary_fingerprint()};
  const int n = world.size();
  Tensor in = Tensor::empty({4}, DType::i32), all = Tensor::empty({4 * int64_t(n)}, DType::i32);
  std::memcpy(in.raw(), mine, sizeof mine);
  world.all_gather(in, all)->wait();
  std::vector<uint64_t> fp(2 * size_t(n));
  std::memcpy(fp.data(), all.raw(), fp.size() * sizeof(uint64_t));

  std::vector<int> other_config, other_binary;
  for (int r = 1; r < n; ++r) {
    if (fp[2 * size_t(r)] != fp[0]) other_config.push_back(r);
    if (fp[2 * size_t(r) + 1] != fp[1]) other_binary.push_back(r);
  }
  if (other_config.empty() && other_binary.empty()) return;

  std::string msg =
      "the ranks were not started alike (every rank must run the same loom binary "
      "with the same configuration):";
  if (!other_binary.empty()) {
    msg += "\n  rank";
    for (int r : other_binary) msg += str_cat(" ", r);
    msg += " run(s) another loom binary than rank 0";
  }
  if (!other_config.empty()) {
    // Every rank takes part in each broadcast, so every rank can name the keys.
    const std::string text0 = broadcast_text(world, toml, 0);
    for (int r : other_config) {
      const std::string text = broadcast_text(world, toml, r);
      std::string keys;
      try {
        const JobConfig a = parse_job_config(text0, "rank 0's configuration");
        const JobConfig b = parse_job_config(text, str_cat("rank ", r, "'s configuration"));
        for (const ConfigDifference& d : config_differences(a, b))
          keys += str_cat("\n    ", d.key, " = ", d.a, " on rank 0, ", d.b, " on rank ", r);
      } catch (const Error& e) {
        keys = str_cat("\n    (cannot compare them: ", e.what(), ")");
      }
      msg += str_cat("\n  rank ", r, "'s configuration differs from rank 0's:", keys);
    }
  }
  fail(msg);
}

}  // namespace

int local_rank() {
  // Open MPI's, Slurm's and torchrun's names for the rank's index on its node.
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

DistRuntime start_distributed(const JobConfig& job, const std::string& command) {
  const ParallelDims dims = parallel_dims(job);
  // Before any collective: a rank without a usable GPU fails here, naming the key.
  check_device_usable(job);
  if (job.training.device == "cuda") ops::start_gpu(local_rank(), job.training.allow_tf32);
  DistRuntime rt;
  if (dist::launched_under_mpi()) {
    rt.mpi = std::make_unique<dist::MpiRuntime>();
    // The process groups move host memory only (Debian's Open MPI is not CUDA-aware; NCCL and
    // pinned staging are issue "loom on NVIDIA GPUs (2 of 2)").
    LOOM_CHECK(rt.mpi->world_size() == 1 || job.training.device != "cuda",
               "training.device = \"cuda\" with ", rt.mpi->world_size(),
               " ranks: this loom trains on one GPU per job so far (several GPUs need the NCCL ",
               "process group); run one process, or --training.device=cpu");
    if (rt.mpi->world_size() > 1) {
      std::shared_ptr<dist::ProcessGroup> world = dist::make_mpi_world_group();
      world->set_timeout_seconds(job.job.collective_timeout_s);
      check_ranks_agree(*world, job);
      // Every rank checks the shape against the world size and fails alike.
      rt.mesh = std::make_unique<dist::Mesh>(dims.mesh_shape(), std::move(world));
      if (job.parallelism.ep > 1) rt.mesh->add_expert_groups(int(job.parallelism.ep));
      rt.mesh->set_timeout_seconds(job.job.collective_timeout_s);
    }
  }
  dims.check_launched(rt.mesh != nullptr, command);
  return rt;
}

ParallelDims parallel_dims(const JobConfig& job) {
  const auto& p = job.parallelism;
  return {.dp_replicate = p.dp_replicate,
          .dp_shard = p.dp_shard,
          .cp = p.cp,
          .tp = p.tp,
          .pp = p.pp,
          .ep = p.ep,
          .sequence_parallel = p.tp_sequence_parallel};
}

ParallelizeOptions parallelize_options(const JobConfig& job) {
  const auto& p = job.parallelism;
  // The config's names as values (each fails naming its key and the accepted values; validate
  // in train/config.cpp has already checked them against the same lists).
  const pp::ScheduleKind schedule = pp::parse_schedule_kind(p.pp_schedule);
  return {.sequence_parallel = p.tp_sequence_parallel,
          .tp_recompute_allgather = p.tp_recompute_allgather,
          .tp_async = p.tp_async,
          .cp_allgather = p.cp_rotate_method == "allgather",
          .ac = ActivationCheckpoint::parse(job.activation_checkpoint.mode,
                                            job.activation_checkpoint.selective_option),
          .fsdp = {parallel::reshard_policy_from_name(p.fsdp_reshard_after_forward),
                   dtype_from_name(job.training.mixed_precision_reduce)},
          .device = job.training.device == "cuda" ? Device::cuda : Device::cpu,
          .cpu_offload = job.training.enable_cpu_offload,
          .pp_schedule = schedule,
          .pp_schedule_csv = p.pp_schedule_csv,
          .pp_stage_layers = p.pp_stage_layers,
          .pp_microbatches = int(pipeline_microbatches(job)),
          .pp_stages_per_rank = int(p.pp_stages_per_rank ? p.pp_stages_per_rank
                                                         : pp::default_stages_per_rank(schedule)),
          .pp_fsdp_gather = pp_fsdp_gather_from_name(p.pp_fsdp_gather)};
}

int64_t pipeline_microbatches(const JobConfig& job) {
  const auto& p = job.parallelism;
  if (p.pp == 1) return 1;
  if (!p.pp_schedule_csv.empty()) return pp::read_schedule_csv(p.pp_schedule_csv).microbatches;
  if (p.pp_microbatches) return p.pp_microbatches;
  const int64_t v = p.pp_stages_per_rank
                        ? p.pp_stages_per_rank
                        : pp::default_stages_per_rank(pp::parse_schedule_kind(p.pp_schedule));
  return p.pp * v;
}

ModelConfig job_model_config(const JobConfig& job, const std::string& path) {
  ModelConfig mc = ModelConfig::from_file(path);
  const JobConfig::Moe& o = job.moe;
  MoeConfig* moe = mc.moe_or_null();
  if (!moe) {
    for (const auto& [key, v] : {std::pair{"moe.capacity_factor", o.capacity_factor},
                                 std::pair{"moe.bias_update_rate", o.bias_update_rate},
                                 std::pair{"moe.load_warning", o.load_warning}})
      LOOM_CHECK(v == 0, key, " = ", v, ": the model (", path, ", model_type \"", mc.model_type(),
                 "\") has no experts (expected 0)");
    return mc;
  }
  moe->training = {o.capacity_factor, o.bias_update_rate, o.load_warning};
  moe->expert_bias = moe->expert_bias || o.bias_update_rate > 0;
  return mc;
}

}  // namespace loom
