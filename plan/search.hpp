#pragma once
// `loom plan --search`: the layouts of a world of N ranks (tp, cp and pp dividing N, dp_shard the
// rest; with pp the 1F1B and interleaved schedules; for a mixture of experts every expert-parallel
// degree ep (a divisor of its experts and of dp_shard x cp, whose ranks ep borrows: the layout's
// name says ", ep N"; other models' names are as before); activation checkpointing none, selective
// op and full; a layout that does not fit and shards its states is tried again with CPU offload, AC
// full first and no further than the first offloaded one that does not fit), each planned on the
// meta device at its representative ranks and timed on the hardware model; those that fit first,
// highest throughput (the job's tokens/s: the batch grows with the data-parallel ranks) first. The
// layouts loom refuses (tp not dividing the heads, a sequence cp cannot split, more stages than
// blocks...) are skipped, with the refusal counted: the same checks as `loom train`'s, since the
// same code plans them.
#include <string>
#include <vector>

#include "plan/layout_plan.hpp"

namespace loom::plan {

struct SearchEntry {
  // "fsdp 8 x tp 8 x cp 1 x pp 8 interleaved_1f1b[, ep 8], ac full[, cpu offload]"
  std::string layout;
  JobConfig job;
  size_t peak = 0;        // the largest planned peak allocated
  size_t reserved = 0;    // the largest planned peak reserved (the allocator's cache included)
  double job_tokens = 0;  // per step: the global batch, which grows with the data-parallel ranks
  double step = 0, mfu = 0, tokens_per_s = 0;  // 0 when it does not fit (not timed)
  bool fits = false;
  bool states_only = false;  // the states alone exceed the capacity: peak is their size, no step
};

struct SearchResult {
  std::vector<SearchEntry> entries;  // fitting first by tokens/s; then the rest by peak
  int refused = 0;                   // layouts loom's checks refused
  std::string first_refusal;         // one of their messages, for the report
};

SearchResult search_layouts(const PlanJob& base, const Hardware& hw, bool oversubscribed);

}  // namespace loom::plan
