#include "plan/expert_load.hpp"

#include <algorithm>

#include "plan/layout_plan.hpp"

namespace loom::plan {

double worst_ep_load(const PlanJob& j) {
  const int64_t ep = j.job.parallelism.ep;
  if (!j.model.is_moe() || ep <= 1) return 1;
  const MoeConfig& c = j.model.moe("plan: the experts' worst load");
  const int64_t k = c.num_experts_per_tok, local = c.num_experts / ep;
  return double(ep) * double(std::min(k, local)) / double(k);
}

std::optional<EpWorstCase> ep_worst_case(const PlanJob& j, const std::vector<int>& ranks,
                                         const Hardware& hw, bool oversubscribed) {
  const double load = worst_ep_load(j);
  if (load == 1) return std::nullopt;
  PlanJob worst = j;
  worst.ep_load = load;
  const LayoutPlan lp = plan_whole(worst, ranks, hw, oversubscribed, /*time_unfit=*/false);
  EpWorstCase out;
  out.load = load;
  out.peak = lp.peak();
  for (const RankPlan& r : lp.ranks) out.reserved = std::max(out.reserved, r.peak_reserved);
  out.fits = lp.fits;
  return out;
}

}  // namespace loom::plan
