#pragma once
// A whole layout planned: its ranks' plans (train/rank_plan.hpp), their step times on a hardware
// model (plan/time_model.hpp; with pp every stage rank is planned for the schedule's timing), and
// the job-level figures `loom plan` and its search report.
#include <vector>

#include "plan/hardware.hpp"
#include "plan/time_model.hpp"
#include "train/rank_plan.hpp"

namespace loom::plan {

struct LayoutPlan {
  std::vector<RankPlan> ranks;  // the ranks asked for, in that order
  std::vector<StepTime> times;  // theirs (with pp, the pipeline's step for each); see time_unfit
  double job_tokens = 0;        // per step: every data-parallel rank's micro-batches
  double model_flops_per_token = 0;
  bool fits = true;     // every planned rank's peak allocated within the hardware's capacity
  size_t peak() const;  // the largest peak allocated of the planned ranks
  double step() const;  // the slowest planned rank's step (0: not timed)
  double mfu(const Hardware& hw, DType compute, int world) const;  // torchtitan's convention
};

// `oversubscribed`: every rank on one node (mpirun --oversubscribe on this machine).
// `time_unfit` false: planning stops at the first rank that does not fit (`ranks` then holds
// those planned so far, and peak() is a lower bound), and the layout is not timed (no times):
// the pp stages' plans are what a search of big pipelines spends its time on.
LayoutPlan plan_whole(const PlanJob& j, const std::vector<int>& ranks, const Hardware& hw,
                      bool oversubscribed, bool time_unfit = true);

}  // namespace loom::plan
