// pp_trace: reads the per-rank Chrome traces of a pipeline run (`[profiling] trace = DIR`,
// DIR/rank-R.json) next to the schedule that ran, regenerated from its parameters.
//
//   pp_trace check  DIR SCHEDULE P V M STEPS
//     Every step span of every pp rank holds each action of that rank's list exactly once, in the
//     list's order, times the rounds of the step (grad_accum_steps); exactly STEPS steps. Exit 1
//     naming the rank, step and action otherwise.
//   pp_trace replay DIR SCHEDULE P V M MESSAGE_BYTES
//     Per action (stage, op, micro-batch) the mean CPU time over the steps after the first,
//     replayed through the simulator (parallel/pipeline/simulate): the bubble with these costs,
//     next to the closed form at F = 1, B = 2 (I = W = 1); and per rank the point-to-point bytes of
//     a step (the pp group's counters, recorded in the trace) next to the analytic figure (the
//     rank's messages x MESSAGE_BYTES x rounds), which must be equal. Exit 1 when they are not.
//
// With other mesh dims the world rank R is pp rank R / (world / P) (pp is the outermost dim).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
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
  std::vector<Span> steps, actions, sends;
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

double closed_form_bubble(const pp::Schedule& s) {
  const double p = s.ranks, m = s.microbatches, v = s.stages_per_rank();
  if (s.name == "zb1p") return (p - 1) / (3 * m + p - 1);
  if (s.name == "zbv") return (p - 1) / (6 * m + p - 1);
  return (p - 1) / (v * m + p - 1);
}

int replay(char** argv) {
  const auto traces = read_traces(argv[2]);
  const pp::Schedule s = schedule_of(argv);
  const double message_bytes = std::stod(argv[7]);
  const int world = int(traces.size());
  // (stage, op, mb) -> summed CPU us and count, over the steps after the first (allocations).
  std::map<std::tuple<int, int, int>, std::pair<double, int>> cost;
  std::vector<double> bytes(size_t(world), 0), rounds(size_t(world), 0);
  int bad = 0;
  for (const RankTrace& t : traces) {
    LOOM_CHECK(t.steps.size() >= 2, "rank ", t.world_rank, ": ", t.steps.size(),
               " steps in the trace; the replay needs 2 or more (the first is left out)");
    for (size_t k = 1; k < t.steps.size(); ++k) {
      for (const Span* a : within(t.actions, t.steps[k])) {
        const std::string kind = a->args.at("kind");
        const int op = int(std::string("FBIW").find(kind));
        auto& c = cost[{a->args.at("stage").get<int>(), op, a->args.at("mb").get<int>()}];
        c.first += a->cpu;
        c.second += 1;
      }
    }
    // Bytes and rounds of the last step.
    for (const Span* w : within(t.sends, t.steps.back())) {
      bytes[size_t(t.world_rank)] += w->args.at("p2p_bytes").get<double>();
      rounds[size_t(t.world_rank)] += 1;
    }
  }
  const pp::SimResult r = pp::simulate(s, [&](const pp::Action& a) {
    const auto it = cost.find({a.stage, int(a.op), a.mb});
    LOOM_CHECK(it != cost.end(), "no span of action ", pp::to_string(a), " in the traces");
    return it->second.first / it->second.second;
  });
  LOOM_CHECK(!r.deadlock, "the schedule deadlocks: ", r.blocked);
  double busy = 0;
  for (double b : r.busy) busy += b;
  std::printf(
      "%-16s p %d v %d m %2d: replayed bubble %.4f (closed form %.4f, difference %+.4f); "
      "makespan %.1f ms of CPU time, mean busy %.1f ms per rank\n",
      s.name.c_str(), s.ranks, s.stages_per_rank(), s.microbatches, r.bubble(),
      closed_form_bubble(s), r.bubble() - closed_form_bubble(s), r.makespan / 1e3,
      busy / s.ranks / 1e3);
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
