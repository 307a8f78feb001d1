#include "plan/search.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace loom::plan {

namespace {

std::vector<int64_t> divisors_up_to(int64_t n, int64_t cap) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= std::min(n, cap); d *= 2)
    if (n % d == 0) out.push_back(d);
  return out;
}

// The expert-parallel degrees of a mixture of experts over `fsdp` = dp_shard x cp ranks: the
// divisors of its E experts that divide fsdp (MoeModel's and ParallelDims' rules); {1} for a
// model without experts.
std::vector<int64_t> ep_degrees(const ModelConfig& model, int64_t fsdp) {
  if (!model.is_moe()) return {1};
  const int64_t E = model.moe("plan --search").num_experts;
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= std::min(E, fsdp); ++d)
    if (E % d == 0 && fsdp % d == 0) out.push_back(d);
  return out;
}

// Plans layout `j` into `res` (a refusal is counted instead); whether it fits.
bool plan_entry(const PlanJob& j, const std::string& name, const Hardware& hw, bool oversubscribed,
                DType compute, SearchResult& res) {
  SearchEntry e;
  e.layout = name;
  e.job = j.job;
  try {
    const std::vector<int> ranks = representative_ranks(plan_layout(j));
    // The states alone (parameters, gradients, AdamW) over the capacity: no step can fit,
    // whatever the activations; their size is reported as the peak's lower bound.
    PlanJob states = j;
    states.states_only = true;
    size_t least = 0;
    for (int r : ranks) least = std::max(least, plan_rank(states, r).peak_allocated);
    if (double(least) > hw.capacity) {
      e.peak = least;
      e.states_only = true;
      res.entries.push_back(std::move(e));
      return false;
    }
    // Only what fits is ranked by time: the others are not timed.
    const LayoutPlan lp = plan_whole(j, ranks, hw, oversubscribed, false);
    e.peak = lp.peak();
    for (const RankPlan& r : lp.ranks) e.reserved = std::max(e.reserved, r.peak_reserved);
    e.job_tokens = lp.job_tokens;
    e.step = lp.step();
    e.mfu = lp.mfu(hw, compute, int(j.world));
    e.tokens_per_s = e.step > 0 ? lp.job_tokens / e.step : 0;
    e.fits = lp.fits;
  } catch (const Error& err) {
    if (res.refused++ == 0) res.first_refusal = str_cat(e.layout, ": ", err.what());
    return false;
  }
  res.entries.push_back(std::move(e));
  return res.entries.back().fits;
}

}  // namespace

SearchResult search_layouts(const PlanJob& base, const Hardware& hw, bool oversubscribed) {
  SearchResult res;
  const int64_t n = base.world;
  const DType compute = dtype_from_name(base.job.training.mixed_precision_param);
  // tp stays inside a node (the mesh puts it innermost); powers of two, as the models' heads are.
  for (int64_t tp : divisors_up_to(n, std::max(1, hw.ranks_per_node)))
    for (int64_t cp : divisors_up_to(n / tp, n))
      for (int64_t pp : divisors_up_to(n / tp / cp, n)) {
        const std::vector<std::string> schedules =
            pp > 1 ? std::vector<std::string>{"1f1b", "interleaved_1f1b"}
                   : std::vector<std::string>{"1f1b"};
        for (const std::string& schedule : schedules)
          for (int64_t ep : ep_degrees(base.model, n / tp / pp)) {
            // Offloaded from the most checkpointing to the least: each needs more memory than the
            // one before, so the first that does not fit ends the retries.
            bool offload_fits = true;
            for (const char* ac : {"full", "selective", "none"}) {
              PlanJob j = base;
              auto& p = j.job.parallelism;
              p.dp_replicate = 1;
              p.dp_shard = n / tp / cp / pp;
              p.tp = tp, p.cp = cp, p.pp = pp, p.ep = ep;
              p.pp_schedule = schedule;
              p.pp_microbatches = 0;  // the schedule's own (pp x its stages per rank)
              p.pp_stages_per_rank = 0;
              j.job.activation_checkpoint.mode = ac;
              j.job.activation_checkpoint.selective_option = "op";
              // ep borrows its ranks from fsdp x cp: a setting of the layout, not a factor of it.
              const std::string name =
                  str_cat("fsdp ", p.dp_shard, " x tp ", tp, " x cp ", cp, " x pp ", pp,
                          pp > 1 ? " " + schedule : std::string(),
                          base.model.is_moe() ? str_cat(", ep ", ep) : std::string(), ", ac ",
                          std::string(ac) == "selective" ? "op" : ac);
              // A layout that does not fit is tried again with its shards offloaded to the host
              // (where it shards them): slower than itself, so only worth it where it does not fit.
              const bool fits =
                  plan_entry(j, j.job.training.enable_cpu_offload ? name + ", cpu offload" : name,
                             hw, oversubscribed, compute, res);
              if (!fits && offload_fits && !j.job.training.enable_cpu_offload &&
                  p.dp_shard * cp > 1) {
                j.job.training.enable_cpu_offload = true;
                offload_fits =
                    plan_entry(j, name + ", cpu offload", hw, oversubscribed, compute, res);
              }
            }
          }
      }
  std::stable_sort(res.entries.begin(), res.entries.end(),
                   [](const SearchEntry& a, const SearchEntry& b) {
                     if (a.fits != b.fits) return a.fits;
                     return a.fits ? a.tokens_per_s > b.tokens_per_s : a.peak < b.peak;
                   });
  return res;
}

}  // namespace loom::plan
