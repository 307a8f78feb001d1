#include "train/data_parallel.hpp"

#include <cstring>
#include <fstream>
#include <string_view>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/attention_block.hpp"

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

DistRuntime start_distributed(const JobConfig& job, const std::string& command) {
  const auto& par = job.parallelism;
  const int64_t asked =
      par.dp_replicate * (par.dp_shard == -1 ? 1 : par.dp_shard) * par.tp * par.cp * par.pp;
  DistRuntime rt;
  if (dist::launched_under_mpi()) {
    rt.mpi = std::make_unique<dist::MpiRuntime>();
    if (rt.mpi->world_size() > 1) {
      dist::MeshShape shape;
      shape.pp = int(par.pp);
      shape.dp_replicate = int(par.dp_replicate);
      shape.dp_shard = int(par.dp_shard);
      shape.cp = int(par.cp);
      shape.tp = int(par.tp);
      std::shared_ptr<dist::ProcessGroup> world = dist::make_mpi_world_group();
      world->set_timeout_seconds(job.job.collective_timeout_s);
      check_ranks_agree(*world, job);
      // Every rank checks the shape against the world size and fails alike.
      rt.mesh = std::make_unique<dist::Mesh>(shape, std::move(world));
      rt.mesh->set_timeout_seconds(job.job.collective_timeout_s);
    }
  }
  LOOM_CHECK(rt.mesh || asked == 1, "parallelism asks for ", asked,
             " ranks (dp_replicate=", par.dp_replicate, " dp_shard=", par.dp_shard, " tp=", par.tp,
             " cp=", par.cp, " pp=", par.pp,
             ") but this process was not started by an MPI launcher: run `mpirun -np ", asked,
             " loom ", command, " ...` (or srun)");
  return rt;
}

DpGroups dp_groups(dist::Mesh* mesh) {
  DpGroups g;
  if (!mesh) return g;
  g.dp = &mesh->group("dp");
  g.rank = g.dp->rank();
  g.size = g.dp->size();
  // Context parallelism: FSDP shards over the flattened dp_shard x cp ranks (each cp rank holds
  // part of every sample, so its gradient is a partial sum like a dp rank's), and with cp the
  // gradients reduce over dp_shard x cp.
  if (mesh->size("cp") > 1) g.cp = &mesh->group("cp");
  if (mesh->size("dp_shard") * mesh->size("cp") > 1)
    g.shard = &mesh->group(mesh->size("cp") > 1 ? "dp_shard,cp" : "dp_shard");
  g.replicate = &mesh->group("dp_replicate");
  if (mesh->size("tp") > 1) g.tp = &mesh->group("tp");
  return g;
}

DpModel make_dp_model(const LlamaConfig& mc, DType compute, const JobConfig& job,
                      const DpGroups& groups) {
  DpModel m;
  m.groups = groups;
  const ShardLayout layout{groups.shard ? groups.shard->rank() : 0,
                           groups.shard ? groups.shard->size() : 1};
  TpOptions tp;
  tp.group = groups.tp;
  tp.sequence_parallel = job.parallelism.tp_sequence_parallel;
  tp.recompute_allgather = job.parallelism.tp_recompute_allgather;
  tp.async = job.parallelism.tp_async;
  CpOptions cp;
  cp.group = groups.cp;
  cp.allgather = job.parallelism.cp_rotate_method == "allgather";
  m.model = std::make_unique<LlamaModel>(mc, compute, Device::cpu, layout, tp, cp);
  m.model->set_activation_checkpoint(ActivationCheckpoint::parse(
      job.activation_checkpoint.mode, job.activation_checkpoint.selective_option));
  const DType reduce = dtype_from_name(job.training.mixed_precision_reduce);
  if (groups.shard) {
    parallel::FsdpConfig fc;
    fc.reshard = parallel::reshard_policy_from_name(job.parallelism.fsdp_reshard_after_forward);
    fc.reduce_dtype = reduce;
    m.fsdp = std::make_unique<parallel::Fsdp>(*m.model, *groups.shard, groups.replicate, fc);
  } else if (groups.dp && groups.dp->size() > 1) {
    m.ddp = std::make_unique<parallel::Ddp>(*m.model, *groups.dp, reduce);
  }
  return m;
}

double DpModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                 int64_t T, float grad_scale, bool last) {
  if (ddp) ddp->set_sync(last);
  if (!groups.cp) {
    const double loss = model->forward_backward(inputs, targets, B, T, grad_scale);
    if (fsdp) fsdp->finish_backward();
    return loss;
  }
  // Context parallelism: this cp rank takes its chunks of every sample (the same samples on
  // every cp rank of a dp rank); the loss is summed over the cp group.
  const int n = groups.cp->size();
  const int sp_tp = groups.tp && model->tp().sequence_parallel ? groups.tp->size() : 1;
  const auto pos = cpu::cp_positions(T, n, groups.cp->rank(), sp_tp);
  const int64_t Tl = int64_t(pos.size());
  std::vector<int32_t> in(size_t(B * Tl)), tg(size_t(B * Tl));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t) {
      in[size_t(b * Tl + t)] = inputs[b * T + pos[size_t(t)]];
      tg[size_t(b * Tl + t)] = targets[b * T + pos[size_t(t)]];
    }
  const double loss = model->forward_backward(in.data(), tg.data(), B, Tl, grad_scale);
  if (fsdp) fsdp->finish_backward();
  return dp_sum(groups.cp, loss);
}

void DpModel::finish_step() {
  if (fsdp) fsdp->finish_step();
  if (ddp) ddp->finish_backward();
}

const char* DpModel::kind() const {
  if (fsdp) return groups.replicate && groups.replicate->size() > 1 ? "HSDP" : "FSDP";
  return ddp ? "DDP" : "single";
}

double dp_sum(dist::ProcessGroup* group, double x) {
  if (!group || group->size() == 1) return x;
  const int n = group->size();
  Tensor mine = Tensor::empty({2}, DType::f32), all = Tensor::empty({2 * n}, DType::f32);
  const float hi = float(x);
  mine.data<float>()[0] = hi;
  mine.data<float>()[1] = float(x - double(hi));
  group->all_gather(mine, all)->wait();
  double s = 0;
  for (int r = 0; r < n; ++r)
    s += double(all.data<float>()[2 * r]) + double(all.data<float>()[2 * r + 1]);
  return s;
}

}  // namespace loom
