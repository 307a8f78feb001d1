#include "plan/time_model.hpp"

#include <algorithm>
#include <map>

#include "core/error.hpp"
#include "parallel/pipeline/simulate.hpp"

namespace loom::plan {

namespace {

CollectiveKind kind_of(const std::string& op) {
  for (CollectiveKind k : kCollectiveKinds)
    if (op == collective_name(k)) return k;
  fail("plan: no time model for the collective '", op, "'");
}

// 0 when the group lies within one node; else how many of its ranks share the first one's node
// (the NICs its collectives run over on each node). `ranks_on_node` beyond the hardware's
// ranks_per_node: oversubscribed, every rank on one node, and no group spans two.
int node_ranks(const GroupTraffic& g, const Hardware& hw, int ranks_on_node) {
  const int rpn = std::max({1, hw.ranks_per_node, ranks_on_node});
  int same = 0;
  bool spans = false;
  for (int r : g.members) {
    const bool here = r / rpn == g.members.front() / rpn;
    same += here;
    spans = spans || !here;
  }
  return spans ? same : 0;
}

// The compute stream's time before and after each kernel, the collectives' end times, and the
// totals (StepTime without the optimizer).
struct Timeline {
  std::vector<double> before, after;
  double end = 0;  // both streams drained
  StepTime t;
};

Timeline run_timeline(const RankPlan& p, const Hardware& hw, int ranks_on_node) {
  const double slow = std::max(1.0, double(ranks_on_node) / std::max(1, hw.ranks_per_node));
  std::vector<double> call_time(p.calls.size()), call_end(p.calls.size(), 0);
  std::map<size_t, double> by_group;
  std::vector<int> spans(p.groups.size());
  for (size_t g = 0; g < p.groups.size(); ++g)
    spans[g] = node_ranks(p.groups[g], hw, ranks_on_node);
  Timeline tl;
  for (size_t i = 0; i < p.calls.size(); ++i) {
    const PlannedCall& c = p.calls[i];
    // Oversubscribed cores slow the transfers too: a CPU's MPI copies through shared memory
    // with the ranks' own cores.
    call_time[i] =
        collective_seconds(kind_of(c.op), c.bytes, p.groups[c.group].size, spans[c.group], hw) *
        slow;
    // A receive's time is its sender's send: the transfer is counted once, on the send.
    if (c.op == "recv") call_time[i] = 0;
    tl.t.comm += call_time[i];
    by_group[c.group] += call_time[i];
  }
  double c = 0, m = 0;  // compute and communication streams
  size_t ci = 0, wi = 0;
  // The rank's compute since its previous collective: a collective first waits for its last
  // member, sync_wait of the compute each member did since then.
  double since_sync = 0;
  auto events_before = [&](uint64_t k) {
    for (; ci < p.calls.size() && p.calls[ci].kernels <= k; ++ci) {
      const double wait = p.groups[p.calls[ci].group].size > 1 ? hw.sync_wait * since_sync : 0.0;
      tl.t.waits += wait;
      since_sync = 0;
      if (hw.transfers_on_core) {
        c += wait;
        tl.t.exposed += wait;
        // The rank's core copies the transfer before its compute goes on.
        c += call_time[ci];
        tl.t.exposed += call_time[ci];
        call_end[ci] = c;
        continue;
      }
      m = std::max(m, c + wait) + call_time[ci];
      call_end[ci] = m;
    }
    for (; wi < p.waits.size() && p.waits[wi].kernels <= k; ++wi) {
      const double until = call_end[p.waits[wi].call];
      if (until > c) tl.t.exposed += until - c, c = until;
    }
  };
  tl.before.resize(p.kernels.size());
  tl.after.resize(p.kernels.size());
  for (size_t k = 0; k < p.kernels.size(); ++k) {
    events_before(k);
    tl.before[k] = c;
    const double s = kernel_seconds(p.kernels[k].work, hw) * slow;
    tl.t.compute += s;
    since_sync += s;
    c += s;
    tl.after[k] = c;
  }
  events_before(UINT64_MAX);
  tl.end = std::max(c, m);
  for (const auto& [g, s] : by_group) tl.t.comm_by_group.push_back({p.groups[g].name, s});
  return tl;
}

double optimizer_time(const RankPlan& p, const Hardware& hw, int ranks_on_node) {
  const double slow = std::max(1.0, double(ranks_on_node) / std::max(1, hw.ranks_per_node));
  // AdamW reads weights, gradients and both moments and writes weights and moments: 28 bytes
  // per f32 parameter of the shards (the moments are 8 bytes of them).
  // Under CPU offload the host steps the shards (p.host holds them).
  return optimizer_seconds(28.0 * double(p.optimizer) / 8.0, hw, p.host > 0) * slow;
}

}  // namespace

StepTime time_rank(const RankPlan& p, const Hardware& hw, int ranks_on_node) {
  Timeline tl = run_timeline(p, hw, ranks_on_node);
  tl.t.optimizer = optimizer_time(p, hw, ranks_on_node);
  tl.t.step = tl.end + tl.t.optimizer;
  return tl.t;
}

StepTime time_pipeline(const PlanJob& j, const std::vector<const RankPlan*>& stages,
                       const Hardware& hw, int ranks_on_node) {
  LOOM_CHECK(!stages.empty() && stages.front()->schedule, "plan: no pipeline schedule to time");
  const pp::Schedule& s = *stages.front()->schedule;
  LOOM_CHECK(int(stages.size()) == s.ranks, "plan: ", stages.size(), " stage plans for ", s.ranks,
             " pp ranks");
  // Per (stage, op): the mean cost of its actions on its rank; per rank: the time outside them.
  // Timed as if each rank had a core of its own; oversubscription is applied after the
  // schedule (below).
  const int own_core = std::min(ranks_on_node, std::max(1, hw.ranks_per_node));
  std::map<std::pair<int, int>, std::pair<double, int>> cost;
  std::vector<Timeline> tls;
  std::vector<double> outside;
  double message = 0;
  for (int r = 0; r < s.ranks; ++r) {
    const RankPlan& p = *stages[size_t(r)];
    tls.push_back(run_timeline(p, hw, own_core));
    const Timeline& tl = tls.back();
    std::map<std::string, pp::Action> by_name;
    for (const pp::Action& a : s.orders[size_t(r)]) by_name[pp::to_string(a)] = a;
    double inside = 0;
    size_t k = 0;
    for (const PlannedAction& a : p.actions) {
      const auto it = by_name.find(a.name);
      if (it == by_name.end()) continue;
      while (k < p.kernels.size() && p.kernels[k].at_us < a.begin_us) ++k;
      const size_t first = k;
      while (k < p.kernels.size() && p.kernels[k].at_us <= a.end_us) ++k;
      const double t = k > first ? tl.after[k - 1] - tl.before[first] : 0;
      auto& [sum, n] = cost[{it->second.stage, int(it->second.op)}];
      sum += t, ++n;
      inside += t;
    }
    outside.push_back(tl.end - inside);
    for (const PlannedCall& c : p.calls)
      if (c.op == "send" && p.groups[c.group].name == "pp")
        message = std::max(
            message, collective_seconds(CollectiveKind::send, c.bytes, 2,
                                        node_ranks(p.groups[c.group], hw, ranks_on_node), hw));
  }
  const pp::SimResult sim = pp::simulate(
      s,
      [&](const pp::Action& a) {
        const auto it = cost.find({a.stage, int(a.op)});
        return it == cost.end() ? 0.0 : it->second.first / it->second.second;
      },
      message);
  LOOM_CHECK(!sim.deadlock, "pipeline schedule ", s.name, " deadlocks: ", sim.blocked);
  const double runs = double(j.job.training.grad_accum_steps);
  // Ranks oversubscribed onto fewer cores (slow > 1) share them, but a rank idle in the
  // schedule's bubble, waiting for its neighbour's activations, gives its core to the others: the
  // step is the longer of the schedule's critical path at a core per rank and the node's work
  // (each rank's own timeline and AdamW, every rank on the node) spread over its cores. Without
  // the bubble (time_rank's symmetric ranks) the second is the first times slow. Measured on 2
  // cores, pp 2 x FSDP 2 at 4 ranks: a step 1.7x pp 2's, not 2x.
  const double slow = std::max(1.0, double(ranks_on_node) / std::max(1, hw.ranks_per_node));
  double path = 0, work = 0;
  int critical = 0;
  std::vector<double> opts;
  for (int r = 0; r < s.ranks; ++r) {
    const RankPlan& p = *stages[size_t(r)];
    opts.push_back(optimizer_time(p, hw, own_core));
    const double step = runs * sim.makespan + outside[size_t(r)] + opts.back();
    if (step > path) path = step, critical = r;
    work += (tls[size_t(r)].end + opts.back()) / double(s.ranks);
  }
  // The critical rank's figures, each stretched by the oversubscription as time_rank's are.
  StepTime t = tls[size_t(critical)].t;
  t.optimizer = opts[size_t(critical)];
  for (double* f : {&t.compute, &t.optimizer, &t.comm, &t.exposed, &t.waits}) *f *= slow;
  for (auto& [g, sec] : t.comm_by_group) sec *= slow;
  t.bubble = sim.bubble();
  t.step = std::max(path, slow * work);
  return t;
}

}  // namespace loom::plan
