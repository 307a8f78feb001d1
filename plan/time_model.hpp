#pragma once
// The step time of a plan on a hardware model: the rank's kernels in their order on one compute
// stream (kernel_seconds), its collectives on one communication stream from the moment they are
// issued (collective_seconds over the slowest link the group spans), and a blocking wait holding
// the compute stream until its collective is done. So the overlap is the one loom's code has,
// not a rule written beside it: FSDP's prefetched all-gathers and its reduce-scatters overlap the
// next unit's compute, tensor parallelism's collectives (issued and waited at once) are exposed,
// ring attention's transfers overlap the block in flight. AdamW runs after (optimizer_seconds).
//
// With pp, each stage rank's actions are timed the same way, their mean cost per stage and kind
// (F, B, I, W) feeds the schedule simulator (parallel/pipeline/simulate.hpp) with the message
// time of a send, and the step is the schedule's makespan per run of the schedule plus what the
// rank runs outside its actions (FSDP's last reductions, the norm, AdamW).
#include <string>
#include <vector>

#include "plan/hardware.hpp"
#include "train/rank_plan.hpp"

namespace loom::plan {

struct StepTime {
  double compute = 0;    // the kernels
  double optimizer = 0;  // AdamW
  double comm = 0;       // every collective's own time, overlapped or not
  double exposed = 0;    // time the compute stream waited for a collective (waits included)
  double waits = 0;      // of which for a collective's last member (Hardware::sync_wait)
  double bubble = 0;     // pp: the schedule's idle fraction
  double step = 0;       // the step's time
  std::vector<std::pair<std::string, double>> comm_by_group;  // collective time per group
};

// `ranks_on_node`: how many ranks share one node of `hw` (the job's, or more when ranks are
// oversubscribed onto fewer cores): beyond hw.ranks_per_node each computes, and moves data
// (a CPU's MPI copies with its cores), that much slower.
StepTime time_rank(const RankPlan& plan, const Hardware& hw, int ranks_on_node);

// With pp: `stages[r]` is the plan of pp rank r (any rank of its dp/cp/tp coordinates).
StepTime time_pipeline(const PlanJob& j, const std::vector<const RankPlan*>& stages,
                       const Hardware& hw, int ranks_on_node);

}  // namespace loom::plan
