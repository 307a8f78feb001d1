// pp_trace: reads the per-rank Chrome traces of a pipeline run (`[profiling] trace = DIR`,
// DIR/rank-R.json) next to the schedule that ran, regenerated from its parameters.
//
//   pp_trace check  DIR SCHEDULE P V M STEPS
//     Every step span of every pp rank holds each action of that rank's list exactly once, in the
//     list's order, times the rounds of the step (grad_accum_steps); exactly STEPS steps. Exit 1
//     naming the rank, step and action otherwise.
//   pp_trace replay DIR SCHEDULE P V M MESSAGE_BYTES
//     Per action (stage, op, micro-batch) the least CPU time over the steps after the first,
//     replayed through the simulator (parallel/pipeline/simulate): the bubble with these costs,
//     next to the closed form at the mean cost of each op over all stages (what the bubble would
//     be with the stages balanced; the difference is the stages' imbalance and the spread between
//     micro-batches); and per rank the point-to-point bytes of
//     a step (the pp group's counters, recorded in the trace) next to the analytic figure (the
//     rank's messages x MESSAGE_BYTES x rounds), which must be equal. Exit 1 when they are not.
//
// With other mesh dims the world rank R is pp rank R / (world / P) (pp is the outermost dim).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/simulate.hpp"

namespace {

using loom::str_cat;
namespace pp = loom::pp;

struct Span {
  std::string name, cat;
  double ts = 0, dur = 0, cpu = 0;
  nlohmann::json args;
};

struct RankTrace {
  int world_rank = 0;
  std::vector<Span> steps, actions, waits, sends;
};

std::vector<RankTrace> read_traces(const std::string& dir) {
  std::vector<RankTrace> out;
  for (int r = 0;; ++r) {
    const auto path = std::filesystem::path(dir) / str_cat("rank-", r, ".json");
    if (!std::filesystem::exists(path)) break;
    std::ifstream f(path);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
      loom::fail("'", path.string(), "' is not valid JSON: ", e.what());
    }
    RankTrace t;
    t.world_rank = r;
    for (const auto& e : j.at("traceEvents")) {
      if (e.at("ph") != "X") continue;
      Span s{e.at("name"), e.at("cat"), e.at("ts"), e.at("dur"), e.at("args").at("cpu_us"),
             e.at("args")};
      if (s.cat == "step") t.steps.push_back(s);
      if (s.cat == "action") t.actions.push_back(s);
      if (s.cat == "wait") t.waits.push_back(s);
      if (s.cat == "wait" && s.name == "sends") t.sends.push_back(s);
    }
    out.push_back(std::move(t));
  }
  LOOM_CHECK(!out.empty(), "no rank-0.json in '", dir, "'");
  return out;
}

// The spans of `spans` inside step span `st`, in time order (recorded in order).
std::vector<const Span*> within(const std::vector<Span>& spans, const Span& st) {
  std::vector<const Span*> out;
  for (const Span& s : spans)
    if (s.ts >= st.ts && s.ts + s.dur <= st.ts + st.dur + 1e-3) out.push_back(&s);
  return out;
}

pp::Schedule schedule_of(char** argv) {
  const pp::ScheduleKind kind = pp::parse_schedule_kind(argv[3]);
  const int p = std::stoi(argv[4]), m = std::stoi(argv[6]);
  int v = std::stoi(argv[5]);
  if (v == 0) v = pp::default_stages_per_rank(kind);
  return pp::make_schedule(kind, p, v, m);
}

int pp_rank_of(int world_rank, int world, int p) {
  LOOM_CHECK(world % p == 0, world, " trace files, not a multiple of pp = ", p);
  return world_rank / (world / p);
}

int check(char** argv) {
  const auto traces = read_traces(argv[2]);
  const pp::Schedule s = schedule_of(argv);
  const int64_t steps = std::stoll(argv[7]);
  const int world = int(traces.size());
  int bad = 0;
  int64_t checked = 0;
  for (const RankTrace& t : traces) {
    const int r = pp_rank_of(t.world_rank, world, s.ranks);
    const auto& order = s.orders[size_t(r)];
    if (int64_t(t.steps.size()) != steps) {
      std::printf("rank %d: %zu step spans, expected %lld\n", t.world_rank, t.steps.size(),
                  (long long)steps);
      ++bad;
    }
    for (const Span& st : t.steps) {
      const auto acts = within(t.actions, st);
      const size_t rounds = order.empty() ? 0 : acts.size() / order.size();
      bool ok = rounds >= 1 && acts.size() == rounds * order.size();
      for (size_t k = 0; ok && k < acts.size(); ++k) {
        const pp::Action& a = order[k % order.size()];
        const std::string want = pp::to_string(a);
        if (acts[k]->name != want || acts[k]->args.at("stage") != a.stage ||
            acts[k]->args.at("mb") != a.mb) {
          std::printf("rank %d %s: action %zu is %s, the schedule's is %s\n", t.world_rank,
                      st.name.c_str(), k, acts[k]->name.c_str(), want.c_str());
          ok = false;
        }
      }
      if (!ok) {
        std::printf("rank %d %s: %zu actions, not the schedule's %zu once per round\n",
                    t.world_rank, st.name.c_str(), acts.size(), order.size());
        ++bad;
      }
      checked += int64_t(acts.size());
    }
  }
  std::printf("%s: %d ranks, %lld steps, %lld action spans checked against the schedule: %s\n",
              s.name.c_str(), world, (long long)steps, (long long)checked, bad ? "FAILED" : "ok");
  return bad ? 1 : 0;
}

// Mean CPU time of each op (F, B, I, W) over every stage and micro-batch: the balanced pipeline
// the closed forms describe.
struct MeanCosts {
  double op[4] = {0, 0, 0, 0};
  double f() const { return op[0]; }
  double i() const { return op[2]; }
  double w() const { return op[3]; }
};

// The bubble of the schedule with equal stages at mean costs c, in closed form: (p-1)/(vm+p-1)
// for gpipe, 1f1b and interleaved at any F:B ratio; for ZB-H1 the Zero Bubble paper's
// (p-1)(F+I-W) idle per rank against m(F+I+W) of work (F = I = W gives the spec's
// (p-1)/(3m+p-1)). ZB-V has none for unequal costs: nullopt, and the replay then compares with
// the simulator at uniform costs.
std::optional<double> closed_form_bubble(const pp::Schedule& s, const MeanCosts& c) {
  const double p = s.ranks, m = s.microbatches, v = s.stages_per_rank();
  if (s.name == "zbv") return std::nullopt;
  if (s.name == "zb1p") {
    const double idle = (p - 1) * (c.f() + c.i() - c.w()), work = m * (c.f() + c.i() + c.w());
    return idle / (work + idle);
  }
  return (p - 1) / (v * m + p - 1);
}

int replay(char** argv) {
  const auto traces = read_traces(argv[2]);
  const pp::Schedule s = schedule_of(argv);
  const double message_bytes = std::stod(argv[7]);
  const int world = int(traces.size());
  // (stage, op, mb) -> CPU us of each step after the first (allocations).
  std::map<std::tuple<int, int, int>, std::vector<double>> samples;
  std::vector<double> bytes(size_t(world), 0), rounds(size_t(world), 0);
  double wall_run = 0, wall_busy = 0;  // over every rank and step after the first
  int bad = 0;
  for (const RankTrace& t : traces) {
    LOOM_CHECK(t.steps.size() >= 2, "rank ", t.world_rank, ": ", t.steps.size(),
               " steps in the trace; the replay needs 2 or more (the first is left out)");
    for (size_t k = 1; k < t.steps.size(); ++k) {
      // The schedule's run on this rank: from its first wait or action to the end of its wait for
      // the sends (the step span also holds the norm and the optimizer).
      const auto acts = within(t.actions, t.steps[k]), waits = within(t.waits, t.steps[k]);
      if (!acts.empty() && !waits.empty()) {
        const double begin = std::min(acts.front()->ts, waits.front()->ts);
        const Span* end = waits.back();
        wall_run += end->ts + end->dur - begin;
        for (const Span* a : acts) wall_busy += a->dur;
      }
      for (const Span* a : acts) {
        const std::string kind = a->args.at("kind");
        const int op = int(std::string("FBIW").find(kind));
        samples[{a->args.at("stage").get<int>(), op, a->args.at("mb").get<int>()}].push_back(
            a->cpu);
      }
    }
    // Bytes and rounds of the last step.
    for (const Span* w : within(t.sends, t.steps.back())) {
      bytes[size_t(t.world_rank)] += w->args.at("p2p_bytes").get<double>();
      rounds[size_t(t.world_rank)] += 1;
    }
  }
  // The least over steps: ranks share cores, and a neighbour's run between two of an action's
  // instructions costs it cache refills, never saves any; the least is the dedicated-core cost
  // (the mean or even the median left stages 5 to 10% apart that do the same work).
  std::map<std::tuple<int, int, int>, double> cost;
  for (const auto& [key, v] : samples) cost[key] = *std::min_element(v.begin(), v.end());
  const pp::SimResult r = pp::simulate(s, [&](const pp::Action& a) {
    const auto it = cost.find({a.stage, int(a.op), a.mb});
    LOOM_CHECK(it != cost.end(), "no span of action ", pp::to_string(a), " in the traces");
    return it->second;
  });
  LOOM_CHECK(!r.deadlock, "the schedule deadlocks: ", r.blocked);
  double busy = 0;
  for (double b : r.busy) busy += b;
  MeanCosts mean;
  int count[4] = {0, 0, 0, 0};
  for (const auto& [key, c] : cost) {
    mean.op[std::get<1>(key)] += c;
    ++count[std::get<1>(key)];
  }
  for (int k = 0; k < 4; ++k)
    if (count[k]) mean.op[k] /= count[k];
  // Each stage's work per micro-batch (all its ops), to show the imbalance.
  std::map<int, double> stage_work;
  for (const auto& [key, c] : cost) stage_work[std::get<0>(key)] += c;
  std::string per_stage;
  for (const auto& [st, wk] : stage_work)
    per_stage += str_cat(per_stage.empty() ? "" : " ", int(wk / s.microbatches + 0.5));
  const pp::SimResult uniform =
      pp::simulate(s, [&](const pp::Action& a) { return mean.op[int(a.op)]; });
  // Per (stage, op) the mean over micro-batches: the imbalance between stages without the spread
  // between micro-batches.
  std::map<std::pair<int, int>, std::pair<double, int>> by_stage;
  for (const auto& [key, c] : cost) {
    auto& b = by_stage[{std::get<0>(key), std::get<1>(key)}];
    b.first += c;
    b.second += 1;
  }
  const pp::SimResult staged = pp::simulate(s, [&](const pp::Action& a) {
    const auto& b = by_stage.at({a.stage, int(a.op)});
    return b.first / b.second;
  });
  const std::optional<double> closed = closed_form_bubble(s, mean);
  const double reference = closed.value_or(uniform.bubble());
  std::printf(
      "%-16s p %d v %d m %2d: replayed bubble %.4f, %s %.4f (difference %+.4f; simulated at "
      "uniform mean costs %.4f, at each stage's mean costs %.4f); makespan %.1f ms of CPU time, "
      "mean busy %.1f ms per rank; mean "
      "F %.0f B %.0f I %.0f W %.0f us; per stage, all ops of a micro-batch: %s us\n",
      s.name.c_str(), s.ranks, s.stages_per_rank(), s.microbatches, r.bubble(),
      closed ? "closed form at mean costs" : "no closed form, uniform simulation", reference,
      r.bubble() - reference, uniform.bubble(), staged.bubble(), r.makespan / 1e3,
      busy / s.ranks / 1e3, mean.op[0], mean.op[1], mean.op[2], mean.op[3], per_stage.c_str());
  // Only meaningful with a core per rank and nothing else running (the bench's pinned pp 2 run).
  std::printf(
      "  wall clock: idle fraction %.4f (1 - time in actions / the schedule's run, every rank)\n",
      wall_run > 0 ? 1 - wall_busy / wall_run : 0.0);
  const pp::SimResult unit = pp::simulate(s, pp::unit_costs(1, 2, 1, 1));
  for (int w = 0; w < world; ++w) {
    const int pr = pp_rank_of(w, world, s.ranks);
    const double want = double(unit.sends[size_t(pr)]) * message_bytes * rounds[size_t(w)];
    const bool eq = bytes[size_t(w)] == want;
    std::printf(
        "  rank %d (pp rank %d): p2p bytes per step %.0f, analytic %.0f (%d messages x %.0f "
        "bytes x %.0f rounds) %s\n",
        w, pr, bytes[size_t(w)], want, unit.sends[size_t(pr)], message_bytes, rounds[size_t(w)],
        eq ? "equal" : "DIFFERENT");
    if (!eq) ++bad;
  }
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "check" && argc == 8) return check(argv);
    if (cmd == "replay" && argc == 8) return replay(argv);
    std::fprintf(stderr,
                 "usage: pp_trace check DIR SCHEDULE P V M STEPS\n"
                 "       pp_trace replay DIR SCHEDULE P V M MESSAGE_BYTES\n"
                 "  (V = 0: the schedule's default stages per rank)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pp_trace: %s\n", e.what());
    return 2;
  }
}
