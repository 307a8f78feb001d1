#pragma once
// One rank's training step on the meta device: the memory truth of loom (docs/design.md decision
// 9; docs/design.md "The memory truth and its oracle"). The real step of `loom train`
// (parallelize, AdamW, TrainStep, the trainer's micro-batches per step) runs on the meta device,
// whose allocator books every tensor the real run allocates (same sizes, rounding and cache) with
// no memory behind it, over simulated process groups (distributed/sim_process_group.hpp) that
// record every collective instead of moving data. Nothing of the model is materialized, so 405B on
// hundreds of ranks plans on a laptop. Three callers, one function: the trainer's pre-flight (its
// memory against the budget, before anything is allocated), `loom bench step --check` (the
// measured peak and bytes equal to these) and `loom plan` (plan/: the hardware's time on top).
// The tests check it against the memory and bytes derived by hand (tests/support/cost_oracle.hpp).
//
// Two steps run and the second is reported, as `loom bench step` times steps after a warm-up:
// AdamW's moments exist and the allocator's cache is warm. Value-dependent branches take the
// healthy run's path: the loss and the gradient norm come out 0 (finite, under any clip bound).
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "distributed/mesh.hpp"
#include "distributed/sim_process_group.hpp"
#include "model/model_config.hpp"
#include "ops/ops.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "train/config.hpp"

namespace loom {

// One group's traffic in the planned step, by op (ProcessGroup's byte convention).
struct GroupTraffic {
  std::string name;  // "dp_shard", "tp", "dp_shard,cp", "world"...
  int size = 1;
  std::vector<int> members;  // world ranks, in group order
  struct Op {
    std::string op;  // "all_gather", "send"...
    uint64_t calls = 0, bytes = 0;
  };
  std::vector<Op> ops;
  uint64_t calls() const;
  uint64_t bytes() const;
};

// One issued call in order: the time model prices it.
struct PlannedCall {
  size_t group = 0;  // index into RankPlan::groups
  std::string op;
  uint64_t bytes = 0;
  uint64_t kernels = 0;  // issued after this many kernels of the step
};
// A wait that blocks the rank until call `call` is done (no test found it complete before).
struct PlannedWait {
  size_t call = 0;  // index into RankPlan::calls
  uint64_t kernels = 0;
};
struct PlannedKernel {
  ops::KernelWork work;
  double at_us = 0;  // the plan run's clock (that of `actions`)
};
// A pipeline action's span on the plan run's clock: its kernels are those stamped inside.
struct PlannedAction {
  std::string name;  // pp::to_string of the action
  double begin_us = 0, end_us = 0;
};

struct RankPlan {
  int rank = 0;
  std::array<int, dist::kMeshDims> coords{};     // pp, dp_replicate, dp_shard, cp, tp
  std::string role;                              // "pp stage 0", "last rank (padded shard)"...
  size_t peak_allocated = 0, peak_reserved = 0;  // of the second step
  // The peak of the whole run: the model's build, the first step (a cold cache) and the second;
  // what a training run's allocator reports as its peak after a step (`peak_allocated_bytes`).
  size_t run_peak_allocated = 0;
  // Under PlanJob::memory_limit: the step's allocations that gave the cache back first.
  size_t cache_flushes = 0;
  // What the peak is made of (Allocator's MemoryUse).
  std::array<size_t, kMemoryUses> at_peak{};
  size_t states = 0;  // parameters' shards, their gradients, the bf16 mirror, AdamW's moments
  size_t optimizer = 0;
  // CPU offload: host memory at its peak (the offloaded master, gradient and moment shards);
  // the device's peak above holds none of it.
  size_t host = 0;
  int64_t num_params = 0;     // this rank's (its tp slices, unsharded)
  int64_t micro_batches = 0;  // per step, as `loom train` runs them
  int64_t tokens = 0;         // this rank's tokens per step (B x T x micro-batches)
  std::vector<GroupTraffic> groups;
  std::vector<PlannedCall> calls;
  std::vector<PlannedWait> waits;
  std::vector<PlannedKernel> kernels;
  std::vector<PlannedAction> actions;    // with pp
  std::optional<pp::Schedule> schedule;  // with pp: the schedule every pp rank runs
  double flops() const;  // the kernels' total (hardware FLOPs, recomputation included)
};

// The job as `loom train` would run it on `world` ranks.
struct PlanJob {
  JobConfig job;
  ModelConfig model;
  int world = 1;
  // Build the rank's model and optimizer only, no step: its states (a lower bound of the peak)
  // in a fraction of the time; the search uses it to drop layouts that cannot fit.
  bool states_only = false;
  // The device pool's limit in bytes (0: none), as memory.limit_gb sets it for a real run: at
  // the limit the caching allocator gives its cache back before it fails, so reserved memory
  // stays within it while the allocated bytes fit.
  size_t memory_limit = 0;
  // A mixture of experts under ep: the load of the planned rank's experts, the rows they get
  // over the balanced N / ep of every rank's N (1: balanced, what a meta run prices, since it
  // routes nothing; PlannedExpertLoad in parallel/layers/expert_parallel.hpp).
  double ep_load = 1;
};

// The mesh layout of the job (loom::Error naming the key when the world does not fit it).
dist::MeshLayout plan_layout(const PlanJob& j);

// The ranks worth planning: per pp stage the rank at dp = cp = tp = 0, and the world's last rank
// (the last FSDP shard, where padding lives, and the last tp and cp rank); the others mirror one
// of these.
std::vector<int> representative_ranks(const dist::MeshLayout& layout);

// Plans `rank` (loom::Error for bad settings, naming the key, before anything runs).
RankPlan plan_rank(const PlanJob& j, int rank);

}  // namespace loom
