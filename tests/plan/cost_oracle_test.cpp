// The cost oracle (tests/support/cost_oracle.hpp: the analytic memory and bytes, derived by hand)
// against the product's memory truth, one rank's real step on the meta device (plan_rank,
// train/rank_plan.hpp), for the layouts of the `bench_*_model` and `bench_*_bytes` ctests (whose
// real steps `loom bench step --check` holds to the meta run's peak and bytes exactly). Every
// representative rank of a layout: the oracle's bytes per step equal the sum of the plan's group
// bytes exactly, the host memory of CPU offload exactly, and the device peak is within the
// tolerance the bench checks held the analytic figure to (5%; 2% for pp 4; 12% for pp 2 x FSDP 2,
// whose oracle prices the reduce-scatters in flight at an action's peak coarsely; the pp x tp / cp
// cases were byte checks only). In process, over simulated groups: no MPI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "distributed/mesh.hpp"
#include "distributed/sim_process_group.hpp"
#include "parallel/parallelize.hpp"
#include "tests/support/cost_oracle.hpp"
#include "train/config.hpp"
#include "train/launch.hpp"
#include "train/rank_plan.hpp"

using namespace loom;

namespace {

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : ".";
}

struct Layout {
  std::string name;
  int world = 1;
  std::string toml;  // under the source directory
  std::vector<std::string> overrides;
  double tolerance = 0.05;  // of the peak; < 0: bytes only
};

std::ostream& operator<<(std::ostream& os, const Layout& l) {
  return os << l.name;
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<Layout> layouts() {
  const std::string src = source_dir();
  const std::string tiny = "configs/bench-tiny.toml";
  const std::string gla = "--model.config=" + src + "/tests/parity/gla_debug.json";
  const std::string gla_conv = "--model.config=" + src + "/tests/parity/gla_conv_debug.json";
  const std::vector<std::string> gla_bench = {gla, "--training.seq_len=128",
                                              "--training.local_batch_size=2"};
  const std::vector<std::string> tp_bench = {"--model.config=" + src + "/bench/tp-8l.json",
                                             "--parallelism.tp=2", "--training.local_batch_size=4",
                                             "--training.seq_len=128"};
  const std::vector<std::string> pp_bench = {"--model.config=" + src + "/bench/tp-8l.json",
                                             "--training.local_batch_size=1",
                                             "--training.seq_len=64",
                                             "--parallelism.pp=4",
                                             "--parallelism.pp_microbatches=8",
                                             "--training.grad_accum_steps=8"};
  const std::vector<std::string> pp2_fsdp2 = {"--model.config=" + src + "/bench/tp-8l.json",
                                              "--training.local_batch_size=1",
                                              "--training.seq_len=64",
                                              "--parallelism.pp=2",
                                              "--parallelism.dp_shard=2",
                                              "--parallelism.pp_microbatches=4",
                                              "--training.grad_accum_steps=8"};
  const std::string tied = "--model.config=" + src + "/tests/parity/pp_tied.json";
  const std::vector<std::string> pp2_debug = {"--training.local_batch_size=4",
                                              "--training.grad_accum_steps=4", "--parallelism.pp=2",
                                              "--parallelism.pp_microbatches=4"};
  const std::string pp_debug = "--model.config=" + src + "/tests/parity/pp_debug.json";
  const std::string bf16 = "--training.mixed_precision_param=bfloat16";
  const std::string one_shard = "--parallelism.dp_shard=1";
  const std::string ac_full = "--activation_checkpoint.mode=full";
  const std::vector<std::string> ac_op = {"--activation_checkpoint.mode=selective",
                                          "--activation_checkpoint.selective_option=op"};
  return {
      // One process (bench-tiny's own layout), Llama and GLA.
      {"llama_f32", 1, tiny, {}},
      {"llama_bf16", 1, tiny, {bf16}},
      {"gla_f32", 1, tiny, gla_bench},
      {"gla_default_ac_op", 1, tiny,
       std::vector<std::string>{"--model.config=" + src + "/configs/gla-default.json",
                                "--training.seq_len=256", "--training.local_batch_size=2"} +
           ac_op},
      // GLA under data, tensor and context parallelism.
      {"gla_fsdp2", 2, tiny, gla_bench + std::vector<std::string>{"--parallelism.dp_shard=2"}},
      {"gla_ddp2", 2, tiny,
       gla_bench + std::vector<std::string>{"--parallelism.dp_replicate=2", one_shard}},
      {"gla_cp2", 2, tiny, gla_bench + std::vector<std::string>{one_shard, "--parallelism.cp=2"}},
      {"gla_cp2_ac_full", 2, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.cp=2", ac_full}},
      {"gla_fsdp2_cp2", 4, tiny,
       gla_bench + std::vector<std::string>{"--parallelism.dp_shard=2", "--parallelism.cp=2"}},
      {"gla_tp2", 2, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.tp=2",
                                            "--parallelism.tp_sequence_parallel=false"}},
      {"gla_tp2_sp", 2, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.tp=2"}},
      {"gla_tp2_sp_ac_op", 2, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.tp=2"} + ac_op},
      {"gla_fsdp2_tp2", 4, tiny,
       gla_bench + std::vector<std::string>{"--parallelism.dp_shard=2", "--parallelism.tp=2"}},
      {"gla_cp2_tp2", 4, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.cp=2", "--parallelism.tp=2"}},
      {"gla_conv_cp2", 2, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.cp=2", gla_conv}},
      {"gla_conv_cp2_ac_full", 2, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.cp=2", ac_full, gla_conv}},
      {"gla_conv_cp2_tp2", 4, tiny,
       gla_bench + std::vector<std::string>{one_shard, "--parallelism.cp=2", "--parallelism.tp=2",
                                            gla_conv}},
      // Llama under FSDP (and CPU offload), TP (with SP and recomputed all-gathers, without SP,
      // with checkpointing), CP (p2p, allgather with full checkpointing) and all three.
      {"fsdp2", 2, tiny, {"--parallelism.dp_shard=2"}},
      {"fsdp2_offload_bf16",
       2,
       tiny,
       {"--parallelism.dp_shard=2", "--training.enable_cpu_offload=true", bf16}},
      {"fsdp2_tp2_sp", 4, tiny,
       tp_bench + std::vector<std::string>{"--parallelism.dp_shard=2",
                                           "--parallelism.tp_recompute_allgather=true"}},
      {"tp2", 2, tiny,
       tp_bench + std::vector<std::string>{one_shard, "--parallelism.tp_sequence_parallel=false"}},
      {"tp2_sp_ac_full", 2, tiny, tp_bench + std::vector<std::string>{one_shard, ac_full}},
      {"tp2_sp_ac_op", 2, tiny, tp_bench + std::vector<std::string>{one_shard} + ac_op},
      {"cp2", 2, tiny, {one_shard, "--parallelism.cp=2", "--parallelism.cp_rotate_method=p2p"}},
      {"cp2_allgather_ac_full",
       2,
       tiny,
       {one_shard, "--parallelism.cp=2", "--parallelism.cp_rotate_method=allgather", ac_full}},
      {"fsdp2_cp2_tp2", 8, tiny,
       tp_bench + std::vector<std::string>{"--parallelism.dp_shard=2", "--parallelism.cp=2"}},
      // Pipeline parallelism: pp 4 x 8 micro-batches with every schedule, pp 2 tied.
      {"pp4_gpipe", 4, tiny, pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=gpipe"},
       0.02},
      {"pp4_1f1b", 4, tiny, pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=1f1b"},
       0.02},
      {"pp4_interleaved", 4, tiny,
       pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=interleaved_1f1b"}, 0.02},
      {"pp4_zb1p", 4, tiny, pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=zb1p"},
       0.02},
      {"pp4_zbv", 4, tiny, pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=zbv"},
       0.02},
      {"pp4_zbv_bf16", 4, tiny,
       pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=zbv", bf16}, 0.02},
      {"pp4_interleaved_ac_full", 4, tiny,
       pp_bench + std::vector<std::string>{"--parallelism.pp_schedule=interleaved_1f1b", ac_full},
       0.02},
      {"pp2_tied",
       2,
       tiny,
       {tied, "--training.local_batch_size=1", "--training.seq_len=64", "--parallelism.pp=2",
        "--parallelism.pp_microbatches=4", "--training.grad_accum_steps=4"},
       0.02},
      // pp 2 x FSDP 2: FSDP's gathers and reduce-scatters by the rank's action list.
      {"pp2_fsdp2", 4, tiny, pp2_fsdp2, 0.12},
      {"pp2_fsdp2_step", 4, tiny,
       pp2_fsdp2 + std::vector<std::string>{"--parallelism.pp_fsdp_gather=step"}, 0.12},
      {"pp2_fsdp2_zb1p", 4, tiny,
       pp2_fsdp2 + std::vector<std::string>{"--parallelism.pp_schedule=zb1p"}, 0.12},
      {"pp2_fsdp2_zbv", 4, tiny,
       pp2_fsdp2 + std::vector<std::string>{"--parallelism.pp_schedule=zbv"}, 0.12},
      {"pp2_fsdp2_tied", 4, tiny, pp2_fsdp2 + std::vector<std::string>{tied}, 0.12},
      {"pp2_fsdp2_tied_step", 4, tiny,
       pp2_fsdp2 + std::vector<std::string>{tied, "--parallelism.pp_fsdp_gather=step"}, 0.12},
      // pp with tp and cp: bytes only (their bench checks were --check-bytes).
      {"pp2_tp2", 4, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{pp_debug, "--parallelism.tp=2"}, -1},
      {"pp2_tp2_nosp_ac_full", 4, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{pp_debug, "--parallelism.tp=2",
                                            "--parallelism.tp_sequence_parallel=false", ac_full},
       -1},
      {"pp2_tp2_ac2_interleaved", 4, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{pp_debug, "--parallelism.tp=2",
                                            "--activation_checkpoint.mode=selective",
                                            "--activation_checkpoint.selective_option=2",
                                            "--parallelism.pp_schedule=interleaved_1f1b"},
       -1},
      {"pp2_tp2_tied", 4, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{tied, "--parallelism.tp=2"}, -1},
      {"pp2_cp2_tp2", 8, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{pp_debug, "--parallelism.cp=2", "--parallelism.tp=2",
                                            one_shard},
       -1},
      {"gla_pp2_tp2", 4, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{gla, "--parallelism.tp=2"}, -1},
      {"gla_pp2_cp2", 4, "configs/debug.toml",
       pp2_debug + std::vector<std::string>{gla, "--parallelism.cp=2", one_shard}, -1},
  };
}

PlanJob job_of(const Layout& l) {
  const std::string path = source_dir() + "/" + l.toml;
  const JobConfig job = load_job_config(path, l.overrides);
  const std::string dir = path.substr(0, path.rfind('/'));
  return {job, ModelConfig::from_file(resolve_model_config(job.model.config, dir)), l.world};
}

struct OracleFigures {
  oracle::MemoryCost memory;
  uint64_t bytes = 0;
};

// The oracle's figures of `rank`: its model as parallelize() builds it for that rank, on the
// meta device over simulated groups (as plan_rank builds it), priced by the formulas.
OracleFigures oracle_of(const PlanJob& j, int rank) {
  const JobConfig& job = j.job;
  std::vector<int> everyone(size_t(j.world));
  std::iota(everyone.begin(), everyone.end(), 0);
  std::unique_ptr<dist::Mesh> mesh;
  if (j.world > 1)
    mesh = std::make_unique<dist::Mesh>(
        parallel_dims(job).resolved(j.world).mesh_shape(),
        std::make_shared<dist::SimProcessGroup>("world", rank, everyone,
                                                std::make_shared<dist::SimLog>()));
  ParallelizeOptions options = parallelize_options(job);
  options.device = Device::meta;
  ParallelModel par = parallelize(j.model, dtype_from_name(job.training.mixed_precision_param),
                                  parallel_groups(mesh.get()), options);
  const int64_t B = job.training.local_batch_size, T = job.training.seq_len;
  const int64_t G = job.training.grad_accum_steps * pipeline_microbatches(job);
  return {
      oracle::memory_cost(par, B, T),
      oracle::bytes_per_step(par, dtype_from_name(job.training.mixed_precision_reduce), B, T, G)};
}

class OracleAgainstMetaRun : public testing::TestWithParam<Layout> {};

TEST_P(OracleAgainstMetaRun, BytesEqualPeakWithinTolerance) {
  const Layout& l = GetParam();
  const PlanJob j = job_of(l);
  for (int rank : representative_ranks(plan_layout(j))) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const RankPlan plan = plan_rank(j, rank);
    const OracleFigures o = oracle_of(j, rank);  // after plan_rank: it wants the meta device empty
    uint64_t bytes = 0;
    for (const GroupTraffic& g : plan.groups) bytes += g.bytes();
    EXPECT_EQ(o.bytes, bytes);
    const double ratio = double(plan.peak_allocated) / double(o.memory.total());
    std::printf("oracle %-24s rank %d: peak %zu, oracle %zu, ratio %.4f%s; bytes %llu %s\n",
                l.name.c_str(), rank, plan.peak_allocated, o.memory.total(), ratio,
                l.tolerance < 0 ? " (not checked)" : "", static_cast<unsigned long long>(bytes),
                o.bytes == bytes ? "equal" : "DIFFER");
    if (l.tolerance >= 0) {
      EXPECT_NEAR(ratio, 1.0, l.tolerance)
          << "peak " << plan.peak_allocated << ", oracle " << o.memory.total();
    }
    EXPECT_EQ(o.memory.host, plan.host);
  }
}

INSTANTIATE_TEST_SUITE_P(cost_oracle, OracleAgainstMetaRun, testing::ValuesIn(layouts()),
                         [](const testing::TestParamInfo<Layout>& i) { return i.param.name; });

// Ring attention's formulas (context parallelism): one K/V block's bytes, nothing without cp.
TEST(CostOracleRing, Formulas) {
  EXPECT_EQ(oracle::ring_kv_bytes(10, 2, 8), size_t(10 * 2 * 2 * 8 * 4));
  EXPECT_EQ(oracle::ring_bytes({}, 100, 4, 1), 0u);
  EXPECT_EQ(oracle::ring_working_bytes({}, 100, 10, 4), 0u);
}

}  // namespace
