#include "model/moe_capacity.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/error.hpp"
#include "distributed/group_sum.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

// The runs of consecutive positions of one rank's tokens: (first position, first local index,
// length), in local order.
struct Run {
  int64_t start, first, length;
};
std::vector<Run> runs_of(const std::vector<int64_t>& pos) {
  std::vector<Run> runs;
  for (int64_t t = 0; t < int64_t(pos.size()); ++t) {
    if (!runs.empty() && pos[size_t(t)] == pos[size_t(t - 1)] + 1) {
      ++runs.back().length;
      continue;
    }
    LOOM_CHECK(runs.empty() || pos[size_t(t)] > pos[size_t(t - 1)],
               "moe capacity under context parallelism: a rank's positions must ascend (position ",
               pos[size_t(t)], " after ", pos[size_t(t - 1)], ")");
    runs.push_back({pos[size_t(t)], t, 1});
  }
  return runs;
}

}  // namespace

int64_t expert_capacity(double factor, int64_t tokens, int64_t k, int64_t E) {
  if (!(factor > 0)) return 0;
  return int64_t(std::ceil(double(tokens) * double(k) / double(E) * factor));
}

std::vector<int64_t> cp_capacities(dist::ProcessGroup& cp, const StepContext& ctx,
                                   const Tensor& experts, int64_t E, int64_t capacity) {
  const int n = cp.size(), me = cp.rank();
  const int64_t B = ctx.B, T = ctx.T, k = experts.size(1);
  LOOM_CHECK(int64_t(ctx.cp_pos.size()) == n && experts.size(0) == B * T,
             "moe capacity under context parallelism: expected the positions of ", n,
             " cp ranks and B x T = ", B * T, " routed rows, found ", ctx.cp_pos.size(), " and ",
             experts.size(0));
  // Every rank's runs, and where its counts go in the gathered vector: [rank][sample][run][E].
  std::vector<std::vector<Run>> runs;
  std::vector<size_t> offset;
  size_t total = 0;
  for (int r = 0; r < n; ++r) {
    runs.push_back(runs_of(ctx.cp_pos[size_t(r)]));
    offset.push_back(total);
    total += size_t(B) * runs.back().size() * size_t(E);
  }
  const std::vector<Run>& mine = runs[size_t(me)];
  auto at = [&](int r, int64_t b, size_t run, int64_t e) {
    return offset[size_t(r)] + (size_t(b) * runs[size_t(r)].size() + run) * size_t(E) + size_t(e);
  };
  std::vector<double> counts(total, 0.0);
  const bool real = ops::computes(experts.device());
  if (real) {
    const Tensor host = experts.on_host();
    const int32_t* ex = host.data<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (size_t u = 0; u < mine.size(); ++u)
        for (int64_t t = mine[u].first; t < mine[u].first + mine[u].length; ++t)
          for (int64_t j = 0; j < k; ++j) counts[at(me, b, u, ex[(b * T + t) * k + j])] += 1;
  }
  counts = group_sum_each(&cp, counts);  // each rank's own slots: the others' are zeros
  if (!real) return std::vector<int64_t>(size_t(E), (capacity + n - 1) / n);
  // The micro-batch in one process's token order: sample by sample, every rank's runs by position.
  std::vector<std::tuple<int64_t, int, size_t>> order;  // (start, rank, run)
  for (int r = 0; r < n; ++r)
    for (size_t u = 0; u < runs[size_t(r)].size(); ++u)
      order.emplace_back(runs[size_t(r)][u].start, r, u);
  std::sort(order.begin(), order.end());
  std::vector<int64_t> seen(size_t(E), 0), keep(size_t(E), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (const auto& [start, r, u] : order)
      for (int64_t e = 0; e < E; ++e) {
        const int64_t c = int64_t(counts[at(r, b, u, e)]);
        const int64_t kept = std::clamp<int64_t>(capacity - seen[size_t(e)], 0, c);
        seen[size_t(e)] += c;
        if (r == me) keep[size_t(e)] += kept;
      }
  }
  return keep;
}

}  // namespace loom
