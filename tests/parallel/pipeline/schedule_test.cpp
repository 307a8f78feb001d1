// Pipeline schedules as data, without MPI: every generator over the grid of the issue (p up to 8,
// v 1/2/4, m from p-1 to 32) gives lists that validate, run through the rendezvous simulator
// without deadlock, hold each action once, and whose simulated makespan and per-rank peak equal
// the closed forms of the spec's schedule table; illegal (p, v, m) are refused naming the keys and
// the rule; broken lists are refused naming rank and action; CSV round trip.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <tuple>

#include "core/error.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/schedule_csv.hpp"
#include "parallel/pipeline/simulate.hpp"

namespace loom::pp {
namespace {

struct Case {
  ScheduleKind kind;
  int p, v, m;
};

std::string label(const Case& c) {
  return str_cat(schedule_name(c.kind), " p=", c.p, " v=", c.v, " m=", c.m);
}

// Every (kind, p, v, m) of the grid, legal or not.
std::vector<Case> grid() {
  std::vector<Case> out;
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                         ScheduleKind::interleaved_1f1b, ScheduleKind::zb1p, ScheduleKind::zbv})
    for (int p : {1, 2, 3, 4, 8})
      for (int v : {1, 2, 4})
        for (int m : {p - 1, p, p + 1, 2 * p, 2 * p + 1, 3 * p, 16, 32})
          if (m >= 1) out.push_back({k, p, v, m});
  return out;
}

bool legal(const Case& c) {
  try {
    check_schedule_args(c.kind, c.p, c.v, c.m);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Each (stage, micro-batch) has one F and one B, or one I and one W, counted independently of
// the validator.
void expect_each_once(const Schedule& s, const std::string& what) {
  std::map<std::tuple<int, int, int>, int> n;
  for (const auto& o : s.orders)
    for (const Action& a : o) ++n[{a.stage, int(a.op), a.mb}];
  const bool split = s.split_backward();
  for (int st = 0; st < s.stages; ++st)
    for (int j = 0; j < s.microbatches; ++j) {
      EXPECT_EQ((n[{st, int(Op::F), j}]), 1) << what << " stage " << st << " mb " << j;
      EXPECT_EQ((n[{st, int(Op::B), j}]), split ? 0 : 1) << what;
      EXPECT_EQ((n[{st, int(Op::I), j}]), split ? 1 : 0) << what;
      EXPECT_EQ((n[{st, int(Op::W), j}]), split ? 1 : 0) << what;
    }
  size_t total = 0;
  for (const auto& o : s.orders) total += o.size();
  EXPECT_EQ(total, size_t(s.stages * s.microbatches * (split ? 3 : 2))) << what;
}

// Messages that cross ranks: one activation and one gradient per micro-batch per boundary between
// stages on different ranks.
int expected_sends(const Schedule& s) {
  int crossings = 0;
  for (int st = 0; st + 1 < s.stages; ++st)
    if (s.stage_rank[size_t(st)] != s.stage_rank[size_t(st + 1)]) ++crossings;
  return 2 * s.microbatches * crossings;
}

TEST(PipelineSchedule, GridValidDeadlockFreeAndClosedForms) {
  int checked = 0;
  for (const Case& c : grid()) {
    if (!legal(c)) continue;
    const std::string what = label(c);
    const Schedule s = make_schedule(c.kind, c.p, c.v, c.m);
    ASSERT_NO_THROW(validate(s)) << what;
    expect_each_once(s, what);
    const int v = s.stages_per_rank(), p = c.p, m = c.m;
    // Costs per stage (chunk): F 1, B 2 or F = I = W = 1, so a whole rank's F costs v.
    const SimResult r = simulate(s, unit_costs(1, 2, 1, 1));
    ASSERT_FALSE(r.deadlock) << what << ": " << r.blocked;
    int sends = 0;
    for (int x : r.sends) sends += x;
    EXPECT_EQ(sends, expected_sends(s)) << what;
    for (int k = 0; k < p; ++k) EXPECT_DOUBLE_EQ(r.busy[size_t(k)] + r.idle[size_t(k)], r.makespan);
    switch (c.kind) {
      case ScheduleKind::gpipe:
      case ScheduleKind::one_f_one_b:
        EXPECT_EQ(r.makespan, 3.0 * (m + p - 1)) << what;
        EXPECT_NEAR(r.bubble(), double(p - 1) / (m + p - 1), 1e-12) << what;
        for (int k = 0; k < p; ++k)
          EXPECT_EQ(r.peak_held[size_t(k)], c.kind == ScheduleKind::gpipe ? m : std::min(m, p - k))
              << what << " rank " << k;
        break;
      case ScheduleKind::interleaved_1f1b:
        EXPECT_EQ(r.makespan, 3.0 * (v * m + p - 1)) << what;
        EXPECT_NEAR(r.bubble(), double(p - 1) / (v * m + p - 1), 1e-12) << what;
        // [(v-1) p + 2 (p-1-r) + 1] / v whole ranks; here in stage-micro-batches.
        for (int k = 0; k < p; ++k)
          EXPECT_EQ(r.peak_held[size_t(k)], std::min(v * m, (v - 1) * p + 2 * (p - 1 - k) + 1))
              << what << " rank " << k;
        break;
      case ScheduleKind::zb1p:
        EXPECT_EQ(r.makespan, 3.0 * m + p - 1) << what;
        EXPECT_NEAR(r.bubble(), double(p - 1) / (3 * m + p - 1), 1e-12) << what;
        for (int k = 0; k < p; ++k) EXPECT_EQ(r.peak_held[size_t(k)], p) << what << " rank " << k;
        break;
      case ScheduleKind::zbv:
        // The V fills once m >= 2p - 1 (the spec's rule); below that the last rank's start
        // delay p - 1 plus its 6m of work stays a lower bound.
        if (m >= 2 * p - 1)
          EXPECT_EQ(r.makespan, 6.0 * m + p - 1) << what;
        else
          EXPECT_GE(r.makespan, 6.0 * m + p - 1) << what;
        // p whole ranks' worth held on every rank (2p stages of half a rank each).
        for (int k = 0; k < p; ++k)
          EXPECT_EQ(r.peak_held[size_t(k)], 2 * p) << what << " rank " << k;
        break;
    }
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

TEST(PipelineSchedule, IllegalCombinationsNameKeysAndRule) {
  auto message = [](ScheduleKind k, int p, int v, int m) {
    try {
      make_schedule(k, p, v, m);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto has = [](const std::string& msg, std::initializer_list<const char*> parts) {
    for (const char* x : parts)
      if (msg.find(x) == std::string::npos) return false;
    return true;
  };
  std::string e = message(ScheduleKind::one_f_one_b, 4, 1, 3);
  EXPECT_TRUE(has(e, {"parallelism.pp_microbatches (3)", "parallelism.pp (4)", ">="})) << e;
  e = message(ScheduleKind::interleaved_1f1b, 4, 2, 6);
  EXPECT_TRUE(has(e, {"pp_microbatches (6)", "multiple", "parallelism.pp (4)"})) << e;
  e = message(ScheduleKind::interleaved_1f1b, 4, 1, 8);
  EXPECT_TRUE(has(e, {"pp_stages_per_rank >= 2"})) << e;
  e = message(ScheduleKind::zbv, 2, 4, 8);
  EXPECT_TRUE(has(e, {"zbv", "pp_stages_per_rank = 2"})) << e;
  e = message(ScheduleKind::one_f_one_b, 2, 2, 8);
  EXPECT_TRUE(has(e, {"1f1b", "pp_stages_per_rank = 1"})) << e;
  e = message(ScheduleKind::zb1p, 8, 1, 7);
  EXPECT_TRUE(has(e, {"zb1p", "pp_microbatches (7)"})) << e;
  EXPECT_THROW(parse_schedule_kind("dualpipe"), Error);
  EXPECT_EQ(parse_schedule_kind("interleaved_1f1b"), ScheduleKind::interleaved_1f1b);
  // gpipe fills no steady state, so fewer micro-batches than ranks is legal there.
  EXPECT_EQ(message(ScheduleKind::gpipe, 4, 1, 3), "accepted");
  // Every illegal case of the grid is refused by make_schedule with a key in the message.
  for (const Case& c : grid()) {
    if (legal(c)) continue;
    EXPECT_TRUE(has(message(c.kind, c.p, c.v, c.m), {"parallelism."})) << label(c);
  }
}

std::string validate_error(const Schedule& s) {
  try {
    validate(s);
  } catch (const Error& e) {
    return e.what();
  }
  return "valid";
}

TEST(PipelineSchedule, ValidatorRefusesBrokenLists) {
  const Schedule good = make_schedule(ScheduleKind::zb1p, 2, 1, 4);
  ASSERT_EQ(validate_error(good), "valid");
  // W before its I.
  Schedule s = good;
  auto& o = s.orders[1];
  const auto i = std::find(o.begin(), o.end(), Action{1, Op::I, 0});
  const auto w = std::find(o.begin(), o.end(), Action{1, Op::W, 0});
  std::iter_swap(i, w);
  std::string e = validate_error(s);
  EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
  EXPECT_NE(e.find("1W0"), std::string::npos) << e;
  // A dropped W.
  s = good;
  s.orders[0].erase(std::find(s.orders[0].begin(), s.orders[0].end(), Action{0, Op::W, 3}));
  e = validate_error(s);
  EXPECT_NE(e.find("stage 0 micro-batch 3"), std::string::npos) << e;
  // An action on the wrong rank.
  s = good;
  s.orders[0].push_back({1, Op::F, 0});
  e = validate_error(s);
  EXPECT_NE(e.find("belongs to rank 1"), std::string::npos) << e;
  // Out of micro-batch order (gradients would accumulate in another order than grad accumulation).
  s = make_schedule(ScheduleKind::gpipe, 2, 1, 2);
  std::swap(s.orders[0][2], s.orders[0][3]);
  e = validate_error(s);
  EXPECT_NE(e.find("out of micro-batch order"), std::string::npos) << e;
}

TEST(PipelineSchedule, SimulatorFindsDeadlock) {
  // Locally valid, but rank 0 waits for 1B0's gradient before it sends 0F1, which rank 1 needs
  // before it runs 1B0.
  const Schedule s = parse_schedule_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", "cycle.csv");
  const SimResult r = simulate(s, unit_costs(1, 2, 1, 1));
  EXPECT_TRUE(r.deadlock);
  EXPECT_NE(r.blocked.find("gradient into stage 0 of micro-batch 0 from rank 1"), std::string::npos)
      << r.blocked;
  EXPECT_NE(r.blocked.find("activation into stage 1 of micro-batch 1 from rank 0"),
            std::string::npos)
      << r.blocked;
}

TEST(PipelineSchedule, RendezvousDelaysTransfers) {
  // With a transfer cost c, 1F1B on p ranks pays c on each of the 2(p-1) hops of the critical path.
  const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 4, 1, 8);
  const SimResult a = simulate(s, unit_costs(1, 2, 1, 1), 0);
  const SimResult b = simulate(s, unit_costs(1, 2, 1, 1), 0.25);
  EXPECT_FALSE(b.deadlock);
  EXPECT_GE(b.makespan, a.makespan + 2 * 3 * 0.25);
}

// At one byte per stage-micro-batch from F to its B or W (a zero-bubble I keeps its byte as
// deferred operands) and free messages, the peak bytes are the peak held count, on every rank of
// every legal schedule of the grid.
TEST(PipelineSchedule, PeakBytesAtUnitWeightsArePeakHeld) {
  for (const Case& c : grid()) {
    if (!legal(c)) continue;
    const Schedule s = make_schedule(c.kind, c.p, c.v, c.m);
    MemoryModel mem;
    mem.stages.assign(size_t(s.stages), StageBytes{1, 1, 0, 0, 0});
    const SimResult r = simulate(s, unit_costs(1, 2, 1, 1), 0, &mem);
    ASSERT_EQ(r.peak_bytes.size(), size_t(c.p)) << label(c);
    for (int k = 0; k < c.p; ++k)
      EXPECT_EQ(r.peak_bytes[size_t(k)], double(r.peak_held[size_t(k)]))
          << label(c) << " rank " << k;
  }
}

// gpipe p 2, m 2, F 1, B 2; per stage-micro-batch 10 saved and 5 of backward work, messages 1.
// Rank 0 before its B0 holds both saved sets, micro-batch 1's activation (sent at t 2, still in
// flight at its test at t 2) and both gradients' receive buffers (posted one action ahead), but
// not micro-batch 0's activation (received at t 1, freed at the test at t 2): 10 + 10 + 1 + 2,
// + 5 in B0. Rank 1 after its F1 holds both saved sets (the inputs became saved), + 5 in B0.
// Buffers kept to the end of the step would give rank 0 29.
TEST(PipelineSchedule, PeakBytesCountMessagesUntilSent) {
  const Schedule s = make_schedule(ScheduleKind::gpipe, 2, 1, 2);
  MemoryModel mem;
  mem.stages.assign(2, StageBytes{10, 0, 5, 0, 0});
  mem.message = 1;
  const SimResult r = simulate(s, unit_costs(1, 2, 1, 1), 0, &mem);
  ASSERT_EQ(r.peak_bytes.size(), 2u);
  EXPECT_EQ(r.peak_bytes[0], 28);
  EXPECT_EQ(r.peak_bytes[1], 25);
  EXPECT_TRUE(simulate(s, unit_costs(1, 2, 1, 1)).peak_bytes.empty());
}

TEST(PipelineSchedule, TagsAreUnique) {
  const Schedule s = make_schedule(ScheduleKind::interleaved_1f1b, 2, 4, 8);
  std::map<int, int> seen;
  for (const auto& ops : lower(s))
    for (const LoweredOp& op : ops)
      if (op.step == Step::post_send) ++seen[message_tag(op.msg, s.stages, s.microbatches)];
  EXPECT_EQ(seen.size(), size_t(expected_sends(s)));
  for (auto [tag, n] : seen) EXPECT_EQ(n, 1) << "tag " << tag;
}

TEST(PipelineScheduleCsv, RoundTrip) {
  for (const Case& c : grid()) {
    if (!legal(c) || c.m > 8) continue;
    const Schedule s = make_schedule(c.kind, c.p, c.v, c.m);
    const Schedule back = parse_schedule_csv(schedule_csv(s), "mem.csv");
    EXPECT_EQ(back.orders, s.orders) << label(c);
    EXPECT_EQ(back.stage_rank, s.stage_rank) << label(c);
    EXPECT_EQ(back.stages, s.stages);
    EXPECT_EQ(back.microbatches, s.microbatches);
  }
  const auto path = std::filesystem::temp_directory_path() / "loom_pp_schedule_test.csv";
  const Schedule s = make_schedule(ScheduleKind::zbv, 2, 2, 4);
  write_schedule_csv(s, path.string());
  const Schedule back = read_schedule_csv(path.string());
  std::filesystem::remove(path);
  EXPECT_EQ(back.orders, s.orders);
  EXPECT_EQ(back.stage_rank, s.stage_rank);
}

TEST(PipelineScheduleCsv, TorchtitanLayoutParses) {
  // Two ranks, stages 0..3 looped, with idle (empty) cells and CRLF line ends.
  const Schedule s = make_schedule(ScheduleKind::interleaved_1f1b, 2, 2, 4);
  std::string text;
  for (const auto& o : s.orders) {
    text += ",";
    for (const Action& a : o) text += to_string(a) + ", ";
    text += "\r\n";
  }
  const Schedule back = parse_schedule_csv(text, "custom.csv");
  EXPECT_EQ(back.orders, s.orders);
  EXPECT_EQ(back.stages, 4);
  EXPECT_EQ(back.microbatches, 4);
}

TEST(PipelineScheduleCsv, BadCellsNameFileLineAndCell) {
  auto err = [](const std::string& text) {
    try {
      parse_schedule_csv(text, "x.csv");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  std::string e = err("0F0,0B0\n1F0,1SEND_F0,1B0\n");
  EXPECT_NE(e.find("x.csv: line 2, cell 2: \"1SEND_F0\""), std::string::npos) << e;
  e = err("0F0,1F0,0B0,1B0\n1F0,1B0\n");
  EXPECT_NE(e.find("stage 1 has actions on rows 1 and 2"), std::string::npos) << e;
  e = err("");
  EXPECT_NE(e.find("no actions"), std::string::npos) << e;
  e = err("0F0,0B0\n1F0\n");
  EXPECT_NE(e.find("no full backward of stage 1"), std::string::npos) << e;
}

}  // namespace
}  // namespace loom::pp
