#pragma once
// Expert parallelism (docs/decisions/moe.md): a mixture of experts' E experts split over the ep
// ranks, rank j holding experts [j E/ep, (j + 1) E/ep). Each rank routes its own tokens; its rows,
// sorted by expert (ops::moe_permute), go to the ranks that hold their experts in one
// all-to-all (the counts exchanged first), are regrouped there by local expert for the grouped
// GEMMs, and come back the same way. The exchange is its own inverse's mirror: the gradients of
// the dispatch travel as a combine and those of the combine as a dispatch.
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace dist {
class ProcessGroup;
}  // namespace dist

// One layer's exchange on one rank.
struct ExpertExchange {
  std::vector<int64_t> send_rows;     // [ep]: rows to each rank (its experts' rows of this rank)
  std::vector<int64_t> recv_rows;     // [ep]: rows from each rank
  std::vector<int64_t> local_counts;  // [E / ep]: rows of each local expert, from every rank
  // [R] i32: the received rows (rank by rank, each rank's by expert) in local-expert order
  // (to_local[i] = the received row that is grouped row i), and the inverse.
  Tensor to_local, from_local;
  int64_t rows() const;  // R: the rows this rank's experts compute
};

// The exchange for rows sorted by expert with `counts` [E] per expert (all of them, on this rank).
// One all-to-all of E int32 over `ep`. On meta (nothing routed) every rank is taken to receive
// what it sends (the balanced case the planner prices, or the load PlannedExpertLoad sets); the
// all-to-all is still issued.
ExpertExchange expert_exchange(dist::ProcessGroup& ep, std::span<const int64_t> counts,
                               Device device);
// The planner's routing on meta, where nothing is routed (`loom plan --ep-load`, its worst-case
// line): while one lives, this rank's experts get `load` x N / ep of every rank's N rows, this
// rank's own included (load 1: the balanced counts as they come; at most ep: every row), the
// rest spread evenly over the other ranks' experts. What the rank then receives, regroups and
// computes is that of the most loaded rank of a real run at that load. Per thread (the planning
// one); the innermost holds.
class PlannedExpertLoad {
 public:
  explicit PlannedExpertLoad(double load);
  ~PlannedExpertLoad();
  PlannedExpertLoad(const PlannedExpertLoad&) = delete;
  PlannedExpertLoad& operator=(const PlannedExpertLoad&) = delete;

 private:
  double previous_;
};

// Rows sorted by expert [sum(send_rows), W] -> this rank's experts' rows [R, W], by local expert.
Tensor expert_dispatch(dist::ProcessGroup& ep, const ExpertExchange& x, const Tensor& rows);
// The reverse: rows by local expert [R, W] -> back to where they came from, [sum(send_rows), W].
Tensor expert_combine(dist::ProcessGroup& ep, const ExpertExchange& x, const Tensor& rows);

// Tensor parallelism inside a sparse layer (docs/decisions/moe.md): every tp rank routes every row
// of its tp group (gathered) and computes a slice of each ep rank's experts, tp rank t of ep rank
// j holding experts j E/ep + t E/(ep tp) + [0, E/(ep tp)). `perm` (over all E experts) -> the
// permutation of the choices this tp rank computes: their rows in the same order (ep block by ep
// block, expert by expert), counts [E / tp] (each ep block's slice: the exchange then sees E / tp
// experts), pos -1 (not here: the combine skips them) for the choices of the other tp ranks.
ops::MoePermutation tp_expert_slice(const ops::MoePermutation& perm, int ep, int tp, int tp_rank);

}  // namespace loom
