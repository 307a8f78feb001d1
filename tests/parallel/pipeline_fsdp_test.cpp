// FSDP's reduce-scatter plan under pp (parallel/pipeline_fsdp.hpp), without MPI: for every
// schedule (zero bubble included), with and without tied embeddings, both gather modes, a
// replay of the rank's list checks that a unit's full gradient is reduce-scattered only when
// every contribution of the micro-batches before it has been added (no W still to add into the
// freed buffer), that nothing written is left unreduced, and that step mode reduces each unit
// once. A plan that reduces after I (FSDP's hooks alone) must be caught.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/stage_split.hpp"
#include "parallel/pipeline_fsdp.hpp"

namespace loom {
namespace {

constexpr int kLayers = 8;
constexpr size_t kUnits = kLayers + 2;

using Plan = std::vector<std::vector<size_t>>;

// The violations of `plan` for `rank`'s list (empty: none). Step mode: each written unit once,
// after its last writer.
std::vector<std::string> violations(const pp::Schedule& s, const std::vector<pp::UnitRange>& units,
                                    int rank, bool tied, const Plan& plan, bool step) {
  std::vector<std::string> bad;
  const auto& order = s.orders[size_t(rank)];
  std::vector<int> pending(kUnits, 0), reduced(kUnits, 0);
  std::vector<bool> dirty(kUnits, false);
  for (size_t k = 0; k < order.size(); ++k) {
    const pp::Action& a = order[k];
    if (a.op != pp::Op::F)
      for (size_t u : pp_grad_units(units, a.stage, kUnits, tied)) {
        if (step && reduced[u])
          bad.push_back(str_cat(pp::to_string(a), " writes unit ", u, " after its reduction"));
        dirty[u] = true;
        if (a.op == pp::Op::I) ++pending[u];
        if (a.op == pp::Op::W) --pending[u];
      }
    for (size_t u : plan[k]) {
      if (pending[u] != 0)
        bad.push_back(str_cat("unit ", u, " reduced after ", pp::to_string(a), " with ", pending[u],
                              " W still to add to it"));
      if (!dirty[u])
        bad.push_back(str_cat("unit ", u, " reduced after ", pp::to_string(a), " unwritten"));
      dirty[u] = false;
      ++reduced[u];
    }
  }
  for (size_t u = 0; u < kUnits; ++u) {
    if (dirty[u]) bad.push_back(str_cat("unit ", u, " written and never reduced"));
    if (step && reduced[u] > 1) bad.push_back(str_cat("unit ", u, " reduced ", reduced[u], "x"));
  }
  return bad;
}

struct Case {
  pp::ScheduleKind kind;
  int p, v, m;
};

TEST(PipelineFsdp, ReducePlanWaitsForEveryW) {
  int checked = 0;
  for (const Case c :
       {Case{pp::ScheduleKind::gpipe, 2, 1, 4}, Case{pp::ScheduleKind::one_f_one_b, 2, 1, 4},
        Case{pp::ScheduleKind::one_f_one_b, 4, 1, 8},
        Case{pp::ScheduleKind::interleaved_1f1b, 2, 2, 4}, Case{pp::ScheduleKind::zb1p, 2, 1, 4},
        Case{pp::ScheduleKind::zb1p, 4, 1, 9}, Case{pp::ScheduleKind::zbv, 2, 2, 4},
        Case{pp::ScheduleKind::zbv, 4, 2, 8}}) {
    const pp::Schedule s = pp::make_schedule(c.kind, c.p, c.v, c.m);
    const auto units = pp::stage_units(kLayers, s.stages);
    for (bool tied : {false, true})
      for (PpFsdpGather mode : {PpFsdpGather::microbatch, PpFsdpGather::step})
        for (int r = 0; r < s.ranks; ++r) {
          const Plan plan = pp_fsdp_reduce_plan(s, units, r, kUnits, tied, mode);
          const auto bad = violations(s, units, r, tied, plan, mode == PpFsdpGather::step);
          EXPECT_TRUE(bad.empty()) << s.name << " p=" << c.p << " m=" << c.m << " rank " << r
                                   << (tied ? " tied" : "") << ": " << bad.front();
          ++checked;
        }
  }
  EXPECT_EQ(checked, 2 * 2 * (2 + 2 + 4 + 2 + 2 + 4 + 2 + 4));
}

TEST(PipelineFsdp, ReducesPerMicroBatchWithoutZeroBubble) {
  // 1f1b: every B reduces its stage's units; the head's stage the tied embedding's replica too.
  const pp::Schedule s = pp::make_schedule(pp::ScheduleKind::one_f_one_b, 2, 1, 4);
  const auto units = pp::stage_units(kLayers, s.stages);
  const Plan plan = pp_fsdp_reduce_plan(s, units, 1, kUnits, true, PpFsdpGather::microbatch);
  size_t total = 0;
  for (size_t k = 0; k < plan.size(); ++k) {
    if (s.orders[1][k].op == pp::Op::B) {
      EXPECT_EQ(plan[k].front(), 0u);
      EXPECT_EQ(plan[k].back(), kUnits - 1);
    }
    total += plan[k].size();
  }
  EXPECT_EQ(total, 4 * (units[1].second - units[1].first + 1));
  // Step mode: once, after the last B.
  const Plan once = pp_fsdp_reduce_plan(s, units, 1, kUnits, true, PpFsdpGather::step);
  for (size_t k = 0; k + 1 < once.size(); ++k) EXPECT_TRUE(once[k].empty()) << k;
  EXPECT_EQ(once.back().size(), units[1].second - units[1].first + 1);
}

TEST(PipelineFsdp, ReducingAfterIIsCaught) {
  // What FSDP's hooks alone would do under zero bubble: reduce after I, before W adds the linear
  // layers' weight gradients. The replay must see the W's still to come.
  const pp::Schedule s = pp::make_schedule(pp::ScheduleKind::zb1p, 2, 1, 4);
  const auto units = pp::stage_units(kLayers, s.stages);
  for (int r = 0; r < 2; ++r) {
    const auto& order = s.orders[size_t(r)];
    Plan naive(order.size());
    for (size_t k = 0; k < order.size(); ++k)
      if (order[k].op == pp::Op::I) naive[k] = pp_grad_units(units, order[k].stage, kUnits, false);
    EXPECT_FALSE(violations(s, units, r, false, naive, false).empty()) << "rank " << r;
  }
  EXPECT_THROW(pp_fsdp_gather_from_name("unit"), Error);
}

}  // namespace
}  // namespace loom
