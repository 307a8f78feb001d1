// `loom plan --search` on the debug model over 4 ranks of this machine's model: every layout
// that divides 4 is planned or refused by loom's own checks, and the list is ordered as the
// command promises (fitting first by tokens/s, then the rest by peak).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>

#include "plan/calibrate.hpp"
#include "plan/expert_load.hpp"
#include "plan/layout_plan.hpp"
#include "plan/search.hpp"
#include "train/config.hpp"

using namespace loom;

namespace {

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : ".";
}

PlanJob debug_job(int world, std::vector<std::string> overrides = {}) {
  const std::string src = source_dir();
  const JobConfig job = load_job_config(src + "/configs/debug.toml", overrides);
  return {job, ModelConfig::from_file(resolve_model_config(job.model.config, src + "/configs")),
          world};
}

}  // namespace

TEST(PlanSearch, OrdersFittingLayoutsByThroughput) {
  const plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/h200.toml");
  const plan::SearchResult r = plan::search_layouts(debug_job(4), hw, false);
  ASSERT_FALSE(r.entries.empty());
  // tp x cp x pp over 4 ranks: 1, 2, 4 each with the rest dp_shard, 3 AC modes, 2 pp schedules.
  EXPECT_GT(int(r.entries.size()) + r.refused, 20);
  bool seen_unfit = false;
  for (size_t i = 0; i < r.entries.size(); ++i) {
    const plan::SearchEntry& e = r.entries[i];
    if (!e.fits) {
      seen_unfit = true;
      continue;
    }
    EXPECT_FALSE(seen_unfit) << e.layout << " fits but is listed after one that does not";
    EXPECT_GT(e.step, 0) << e.layout;
    EXPECT_GT(e.peak, 0u) << e.layout;
    // A model without experts: no ep tried, none named.
    EXPECT_EQ(e.job.parallelism.ep, 1) << e.layout;
    EXPECT_EQ(e.layout.find("ep"), std::string::npos) << e.layout;
    if (i > 0 && r.entries[i - 1].fits) {
      EXPECT_GE(r.entries[i - 1].tokens_per_s, e.tokens_per_s) << e.layout;
    }
  }
}

TEST(PlanSearch, DropsLayoutsWhoseStatesCannotFit) {
  plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/h200.toml");
  hw.capacity = 1024;  // less than any layout's parameters
  const plan::SearchResult r = plan::search_layouts(debug_job(2), hw, false);
  ASSERT_FALSE(r.entries.empty());
  for (const plan::SearchEntry& e : r.entries) {
    EXPECT_FALSE(e.fits) << e.layout;
    // Offloaded, the device holds no states: such a layout is planned whole, and fails on its
    // gathered units and activations.
    EXPECT_EQ(e.states_only, !e.job.training.enable_cpu_offload) << e.layout;
    EXPECT_GT(double(e.peak), hw.capacity) << e.layout;
  }
}

// A rank whose allocations fit the capacity but whose allocator's cache would not is planned
// again under the capacity, as a real run's allocator gives its cache back at its limit.
TEST(PlanWhole, HoldsReservedMemoryWithinTheCapacity) {
  plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/h200.toml");
  const PlanJob fsdp =
      debug_job(2, {"--parallelism.dp_shard=2", "--activation_checkpoint.mode=full"});
  const std::vector<int> ranks = representative_ranks(plan_layout(fsdp));
  const plan::LayoutPlan free = plan::plan_whole(fsdp, ranks, hw, false);
  const RankPlan& r0 = free.ranks.front();
  ASSERT_GT(r0.peak_reserved, r0.peak_allocated * 21 / 20) << "no cache to give back";
  EXPECT_EQ(r0.cache_flushes, 0u);
  hw.capacity = double(r0.peak_allocated + r0.peak_reserved) / 2;
  const plan::LayoutPlan capped = plan::plan_whole(fsdp, ranks, hw, false);
  EXPECT_TRUE(capped.fits);
  for (const RankPlan& r : capped.ranks) {
    EXPECT_LE(double(r.peak_reserved), hw.capacity) << r.role;
    EXPECT_LE(double(r.peak_allocated), hw.capacity) << r.role;
    EXPECT_GT(r.cache_flushes, 0u) << r.role;
  }
  // Below what is allocated at once it cannot fit.
  hw.capacity = double(r0.peak_allocated) * 0.9;
  EXPECT_FALSE(plan::plan_whole(fsdp, ranks, hw, false).fits);
}

// Ranks oversubscribed onto fewer cores (`--oversubscribed`): symmetric ranks are slowed by
// ranks / cores (all on one node: the same links); a pipeline's ranks share their cores too, but
// the bubble of one stage is the others' time, so a pp x FSDP step slows by less than that (and
// never speeds up).
TEST(PlanTime, OversubscribedPipelineFillsItsBubble) {
  // A CPU's figures (compute, not latency, dominates the debug model's step there).
  const plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/cpu-local.toml");
  auto step = [&](const PlanJob& j, int cores) {
    plan::Hardware h = hw;
    h.ranks_per_node = cores;
    const std::vector<int> ranks = representative_ranks(plan_layout(j));
    return plan::plan_whole(j, ranks, h, cores < j.world).step();
  };
  const PlanJob fsdp = debug_job(4, {"--parallelism.dp_shard=4"});
  const double own = step(fsdp, 4), shared = step(fsdp, 2);
  EXPECT_NEAR(shared / own, 2.0, 1e-9);
  const PlanJob pp = debug_job(
      4, {"--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.pp_microbatches=4"});
  const double pp_own = step(pp, 4), pp_shared = step(pp, 2);
  EXPECT_GT(pp_shared, pp_own * 1.2);
  EXPECT_LT(pp_shared, pp_own * 1.95);
}

// A CPU's MPI copies with the rank's own core ([links] transfers_on_core): FSDP's prefetched
// gathers and its reduce-scatters no longer overlap the compute, every transfer is exposed.
TEST(PlanTime, TransfersOnTheCoreDoNotOverlapCompute) {
  plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/cpu-local.toml");
  EXPECT_TRUE(hw.transfers_on_core);
  const PlanJob fsdp = debug_job(2, {"--parallelism.dp_shard=2"});
  const std::vector<int> ranks = representative_ranks(plan_layout(fsdp));
  hw.transfers_on_core = false;
  const plan::StepTime gpu_like = plan::plan_whole(fsdp, ranks, hw, false).times.front();
  ASSERT_GT(gpu_like.comm, 0);
  EXPECT_LT(gpu_like.exposed, 0.9 * gpu_like.comm);
  EXPECT_LT(gpu_like.step, gpu_like.compute + gpu_like.comm + gpu_like.optimizer);
  hw.transfers_on_core = true;
  const plan::StepTime cpu = plan::plan_whole(fsdp, ranks, hw, false).times.front();
  EXPECT_DOUBLE_EQ(cpu.compute, gpu_like.compute);
  EXPECT_DOUBLE_EQ(cpu.comm, gpu_like.comm);
  // Exposed, with the waits for the last rank (sync_wait; CollectivesWaitForTheirLastRank).
  EXPECT_NEAR(cpu.exposed, cpu.comm + cpu.waits, 1e-12);
  EXPECT_NEAR(cpu.step, cpu.compute + cpu.comm + cpu.waits + cpu.optimizer, 1e-12);
}

// [links] sync_wait: each collective of a group of several ranks first waits sync_wait of the
// compute since the rank's previous collective, on the compute stream when transfers run on the
// core. A single rank has no such wait.
TEST(PlanTime, CollectivesWaitForTheirLastRank) {
  plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/cpu-local.toml");
  ASSERT_TRUE(hw.transfers_on_core);
  for (const auto& [world, args] : std::vector<std::pair<int, std::vector<std::string>>>{
           {2, {"--parallelism.dp_shard=2"}}, {1, {}}}) {
    const PlanJob job = debug_job(world, args);
    const std::vector<int> ranks = representative_ranks(plan_layout(job));
    hw.sync_wait = 0;
    const plan::StepTime none = plan::plan_whole(job, ranks, hw, false).times.front();
    EXPECT_EQ(none.waits, 0);
    hw.sync_wait = 0.05;
    const plan::StepTime some = plan::plan_whole(job, ranks, hw, false).times.front();
    EXPECT_DOUBLE_EQ(some.compute, none.compute);
    if (world == 1) {
      EXPECT_EQ(some.waits, 0);
      EXPECT_DOUBLE_EQ(some.step, none.step);
      continue;
    }
    // Every second of compute before the last collective is waited on once: FSDP's collectives
    // run through the whole step, so that is most of it.
    EXPECT_LE(some.waits, 0.05 * none.compute + 1e-12);
    EXPECT_GT(some.waits, 0.5 * 0.05 * none.compute);
    EXPECT_NEAR(some.step, none.step + some.waits, 1e-12);
    EXPECT_NEAR(some.exposed, none.exposed + some.waits, 1e-12);
  }
}

// A layout that does not fit is tried again with its states offloaded to the host, and listed
// (as ", cpu offload") among those that fit when that makes it fit; a fitting layout is not.
TEST(PlanSearch, OffloadsLayoutsThatDoNotFit) {
  plan::Hardware hw = plan::load_hardware(source_dir() + "/configs/hardware/h200.toml");
  const plan::SearchResult roomy = plan::search_layouts(debug_job(2), hw, false);
  for (const plan::SearchEntry& e : roomy.entries) {
    EXPECT_TRUE(e.fits) << e.layout;
    EXPECT_FALSE(e.job.training.enable_cpu_offload) << e.layout;
  }
  // Room for FSDP 2 with full checkpointing only once its states are on the host.
  const PlanJob fsdp =
      debug_job(2, {"--parallelism.dp_shard=2", "--activation_checkpoint.mode=full"});
  PlanJob off = fsdp;
  off.job.training.enable_cpu_offload = true;
  const std::vector<int> ranks = representative_ranks(plan_layout(fsdp));
  const size_t on_device = plan::plan_whole(fsdp, ranks, hw, false).peak();
  const plan::LayoutPlan off_plan = plan::plan_whole(off, ranks, hw, false);
  const size_t offloaded = off_plan.peak();
  size_t off_reserved = 0;
  for (const RankPlan& p : off_plan.ranks) off_reserved = std::max(off_reserved, p.peak_reserved);
  // Its cache too fits (no replanning under the capacity, which could change the peak).
  ASSERT_LT(off_reserved, on_device);
  hw.capacity = double(off_reserved);
  const plan::SearchResult r = plan::search_layouts(debug_job(2), hw, false);
  bool found = false;
  for (const plan::SearchEntry& e : r.entries) {
    if (e.layout == "fsdp 2 x tp 1 x cp 1 x pp 1, ac full, cpu offload") {
      found = true;
      EXPECT_TRUE(e.fits);
      EXPECT_TRUE(e.job.training.enable_cpu_offload);
      EXPECT_EQ(e.peak, offloaded);
      EXPECT_GE(e.reserved, e.peak);
      EXPECT_GT(e.job_tokens, 0);
    }
    if (e.layout == "fsdp 2 x tp 1 x cp 1 x pp 1, ac full") {
      EXPECT_FALSE(e.fits);
    }
    // Only layouts that shard their states (FSDP over dp_shard x cp) can offload them.
    if (e.job.training.enable_cpu_offload) {
      EXPECT_GT(e.job.parallelism.dp_shard * e.job.parallelism.cp, 1) << e.layout;
    }
  }
  EXPECT_TRUE(found);
}

// `loom plan calibrate --config`: the step's own GEMM shapes, and their tp/cp/pp splits.
TEST(Calibrate, StepGemmShapesAreTheModelsWithTheirSplits) {
  const PlanJob j = debug_job(1);
  const std::vector<plan::GemmPoint> shapes = plan::step_gemm_shapes(j);
  auto has = [&](int64_t m, int64_t n, int64_t k) {
    return std::any_of(shapes.begin(), shapes.end(),
                       [&](const plan::GemmPoint& p) { return p.m == m && p.n == n && p.k == k; });
  };
  size_t gemms = 0;
  for (const PlannedKernel& k : plan_rank(j, 0).kernels) {
    const ops::KernelWork& w = k.work;
    if (w.m <= 0) continue;
    ++gemms;
    EXPECT_TRUE(has(w.m, w.n, w.k)) << w.op << " " << w.m << "x" << w.n << "x" << w.k;
    if (w.m % 2 == 0 && w.n % 2 == 0) {
      EXPECT_TRUE(has(w.m / 2, w.n / 2, w.k)) << w.op;
    }
  }
  EXPECT_GT(gemms, 0u);
  EXPECT_LT(shapes.size(), gemms * 12 + 1);  // each shape once
}

namespace {

// The debug job with a mixture of experts of 64 experts of 256 x 256 (top-2) over two layers.
PlanJob moe_job(int world, std::vector<std::string> overrides = {}) {
  overrides.push_back("--model.config=" + source_dir() + "/tests/plan/moe_many_experts.json");
  return debug_job(world, overrides);
}

uint64_t group_bytes(const RankPlan& p, const std::string& name) {
  for (const GroupTraffic& g : p.groups)
    if (g.name == name) return g.bytes();
  ADD_FAILURE() << "no group " << name << " in the plan of rank " << p.rank;
  return 0;
}

}  // namespace

// A mixture of experts: every ep dividing its experts and dp_shard x cp is tried and named. Here
// 64 experts of 256 x 256 over 4 ranks and 256 tokens a micro-batch: FSDP's gathers of every
// expert outweigh the all-to-alls of the routed rows, so the fastest layout shards the experts.
TEST(PlanSearch, TriesEveryExpertParallelDegree) {
  const plan::Hardware hw =
      plan::load_hardware(source_dir() + "/configs/hardware/h100-sxm-80g.toml");
  const plan::SearchResult r =
      plan::search_layouts(moe_job(4, {"--training.mixed_precision_param=bfloat16"}), hw, false);
  ASSERT_FALSE(r.entries.empty());
  std::set<std::pair<int64_t, int64_t>> planned;  // (cp, ep) of the fitting layouts
  for (const plan::SearchEntry& e : r.entries) {
    const auto& p = e.job.parallelism;
    EXPECT_NE(e.layout.find(str_cat(", ep ", p.ep, ",")), std::string::npos) << e.layout;
    EXPECT_EQ(64 % p.ep, 0) << e.layout;
    EXPECT_EQ(p.dp_shard * p.cp % p.ep, 0) << e.layout;
    if (e.fits && !e.job.training.enable_cpu_offload) planned.insert({p.cp, p.ep});
  }
  // Among them (with tp and pp layouts): cp 1, 2 and 4 each with ep 1, 2 and 4.
  for (int64_t cp : {1, 2, 4})
    for (int64_t ep : {1, 2, 4})
      EXPECT_TRUE(planned.count({cp, ep})) << "cp " << cp << " ep " << ep << " not planned";
  const plan::SearchEntry& best = r.entries.front();
  ASSERT_TRUE(best.fits);
  EXPECT_GT(best.job.parallelism.ep, 1) << best.layout;
  // The same layout without ep is planned, and slower.
  std::string without = best.layout;
  without.replace(without.find(", ep "), str_cat(", ep ", best.job.parallelism.ep).size(),
                  ", ep 1");
  const auto it = std::find_if(r.entries.begin(), r.entries.end(),
                               [&](const plan::SearchEntry& e) { return e.layout == without; });
  ASSERT_NE(it, r.entries.end()) << without;
  EXPECT_LT(it->tokens_per_s, best.tokens_per_s) << without;
}

// The most loaded rank's experts (PlanJob::ep_load): its exchange, GEMMs and activations follow
// the load, up to the worst a dropless router allows (every token's k choices on its experts).
TEST(PlanExperts, WorstLoadBoundsTheRouting) {
  const plan::Hardware hw =
      plan::load_hardware(source_dir() + "/configs/hardware/h100-sxm-80g.toml");
  const int ep = 4;
  const PlanJob j = moe_job(
      ep, {"--parallelism.dp_shard=4", "--parallelism.ep=4",
           "--training.mixed_precision_param=float32", "--activation_checkpoint.mode=none"});
  // Top-2 of 16 local experts: both choices of every rank's tokens can land on one rank.
  EXPECT_DOUBLE_EQ(plan::worst_ep_load(j), 4.0);
  // Mixtral's 8 experts over ep 8: one expert a rank, so at most one of each token's 2 choices.
  PlanJob mixtral = debug_job(
      8, {"--model.config=mixtral-8x7b", "--parallelism.dp_shard=8", "--parallelism.ep=8"});
  EXPECT_DOUBLE_EQ(plan::worst_ep_load(mixtral), 4.0);
  mixtral.job.parallelism.ep = 2;
  EXPECT_DOUBLE_EQ(plan::worst_ep_load(mixtral), 2.0);
  // Without ep, or without experts, nothing to skew.
  EXPECT_DOUBLE_EQ(plan::worst_ep_load(moe_job(4, {"--parallelism.dp_shard=4"})), 1.0);
  EXPECT_FALSE(plan::ep_worst_case(debug_job(1), {0}, hw, false));

  // The ep group's bytes per step: per sparse layer and micro-batch, out with the rows for the
  // other ranks' experts (N - hot of the N = B T k choices, forward and backward) and back with
  // the rows the other ranks sent (ep - 1) hot, f32 rows of d = 256 (the counts' all-to-all
  // aside): the load moves 8 d (ep - 2) (hot_L - hot_1).
  const int64_t N = 4 * 64 * 2, d = 256, layers = 2;
  const RankPlan balanced = plan_rank(j, 0);
  PlanJob twice = j;
  twice.ep_load = 2;
  const RankPlan loaded = plan_rank(twice, 0);
  EXPECT_EQ(group_bytes(loaded, "ep") - group_bytes(balanced, "ep"),
            uint64_t(8 * d * (ep - 2) * (2 * N / ep - N / ep) * layers));
  EXPECT_GT(loaded.peak_allocated, balanced.peak_allocated);
  // The worst case: every row on the planned rank's experts.
  const std::vector<int> ranks = representative_ranks(plan_layout(j));
  const auto worst = plan::ep_worst_case(j, ranks, hw, false);
  ASSERT_TRUE(worst);
  EXPECT_DOUBLE_EQ(worst->load, 4.0);
  EXPECT_TRUE(worst->fits);
  PlanJob all = j;
  all.ep_load = 4;
  const RankPlan hot = plan_rank(all, 0);
  EXPECT_EQ(group_bytes(hot, "ep") - group_bytes(balanced, "ep"),
            uint64_t(8 * d * (ep - 2) * (N - N / ep) * layers));
  EXPECT_GT(worst->peak, loaded.peak_allocated);
  EXPECT_GE(worst->peak, hot.peak_allocated);
  // The balanced plan is the meta run's own.
  PlanJob one = j;
  one.ep_load = 1;
  EXPECT_EQ(plan_rank(one, 0).peak_allocated, balanced.peak_allocated);
}
