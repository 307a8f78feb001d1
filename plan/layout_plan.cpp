#include "plan/layout_plan.hpp"

#include <algorithm>
#include <utility>

#include "core/error.hpp"

namespace loom::plan {

size_t LayoutPlan::peak() const {
  size_t p = 0;
  for (const RankPlan& r : ranks) p = std::max(p, r.peak_allocated);
  return p;
}

double LayoutPlan::step() const {
  double s = 0;
  for (const StepTime& t : times) s = std::max(s, t.step);
  return s;
}

double LayoutPlan::mfu(const Hardware& hw, DType compute, int world) const {
  if (times.empty()) return 0;
  // Model FLOPs of the job's tokens (6N + 12LHQT per token) over the world's peak.
  return model_flops_per_token * job_tokens / step() / (double(world) * hw.peak(compute));
}

LayoutPlan plan_whole(const PlanJob& j, const std::vector<int>& ranks, const Hardware& hw,
                      bool oversubscribed, bool time_unfit) {
  const dist::MeshLayout layout = plan_layout(j);
  const int ranks_on_node = oversubscribed ? j.world : std::min(j.world, hw.ranks_per_node);
  LayoutPlan out;
  for (int r : ranks) {
    RankPlan p = plan_rank(j, r);
    bool fits = double(p.peak_allocated) <= hw.capacity;
    if (fits && double(p.peak_reserved) > hw.capacity) {
      // The cache outgrew the capacity: plan again under it, as a real run's allocator would
      // run (giving its cache back at the limit); it fits if that run does not fail.
      PlanJob capped = j;
      capped.memory_limit = size_t(hw.capacity);
      try {
        p = plan_rank(capped, r);
      } catch (const Error&) {
        fits = false;
      }
    }
    out.ranks.push_back(std::move(p));
    out.fits = out.fits && fits;
    if (!out.fits && !time_unfit) break;
  }
  out.model_flops_per_token = j.model.flops_per_token(j.job.training.seq_len);
  // cp, tp and pp ranks of a dp rank share its samples.
  out.job_tokens = double(out.ranks.front().micro_batches) *
                   double(j.job.training.local_batch_size) * double(j.job.training.seq_len) *
                   layout.size("dp_replicate") * layout.size("dp_shard");
  if (!out.fits && !time_unfit) return out;
  const int pp = layout.size("pp");
  if (pp > 1) {
    // The schedule is timed across its stages: one plan per pp rank (the planned one of each
    // stage, else its dp = cp = tp = 0 rank, planned here).
    std::vector<const RankPlan*> stages(size_t(pp), nullptr);
    for (const RankPlan& p : out.ranks)
      if (!stages[size_t(p.coords[0])]) stages[size_t(p.coords[0])] = &p;
    std::vector<RankPlan> extra;
    extra.reserve(size_t(pp));
    for (int s = 0; s < pp; ++s)
      if (!stages[size_t(s)]) {
        extra.push_back(plan_rank(j, layout.world_rank_of({s, 0, 0, 0, 0})));
        stages[size_t(s)] = &extra.back();
      }
    out.times.assign(out.ranks.size(), time_pipeline(j, stages, hw, ranks_on_node));
  } else {
    for (const RankPlan& p : out.ranks) out.times.push_back(time_rank(p, hw, ranks_on_node));
  }
  return out;
}

}  // namespace loom::plan
