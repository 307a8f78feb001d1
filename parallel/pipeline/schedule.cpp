#include "parallel/pipeline/schedule.hpp"

#include <algorithm>
#include <optional>
#include <tuple>

#include "core/error.hpp"

namespace loom::pp {
namespace {

const char op_letter[] = {'F', 'B', 'I', 'W'};

// Megatron's order for one rank: `warmup` forwards, then one forward and one backward each, then
// the remaining backwards. fwd(k) and bwd(k) give the k-th forward and backward of the rank.
template <class Fwd, class Bwd>
std::vector<Action> warmup_steady_cooldown(int total, int warmup, Fwd fwd, Bwd bwd) {
  std::vector<Action> out;
  for (int k = 0; k < warmup; ++k) out.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(fwd(warmup + k));
    out.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(bwd(k));
  return out;
}

Schedule looped(const char* name, int p, int v, int m) {
  Schedule s;
  s.name = name;
  s.ranks = p;
  s.stages = p * v;
  s.microbatches = m;
  s.stage_rank.resize(size_t(s.stages));
  for (int st = 0; st < s.stages; ++st) s.stage_rank[size_t(st)] = st % p;
  s.orders.resize(size_t(p));
  return s;
}

// The zero-bubble V: rank r holds stages r and 2p-1-r, so a micro-batch goes down the ranks and
// back up, and the last stage's loss sits on rank 0 beside the first stage. The order is the
// greedy list schedule of the ZB paper's heuristic at unit cost per action (an I first, it is on
// the critical path; then a forward while fewer than `limit` stage-micro-batches are held; then a
// pending W), made on a clock so that readiness is exact. A stage's actions go in micro-batch
// order, so the accumulation order is that of grad_accum_steps.
Schedule greedy_zero_bubble(Schedule s, int limit) {
  const int S = s.stages, m = s.microbatches;
  // done[op][stage][mb]: the time the action finished, -1 while not run.
  std::vector<std::vector<std::vector<int>>> done(
      3, std::vector<std::vector<int>>(size_t(S), std::vector<int>(size_t(m), -1)));
  auto fin = [&](int op, int st, int j) {
    if (st < 0 || st >= S || j < 0) return 0;  // nothing to wait for
    return done[size_t(op)][size_t(st)][size_t(j)];
  };
  auto ready = [&](int op, int st, int j, int t) {
    if (done[size_t(op)][size_t(st)][size_t(j)] >= 0) return false;
    auto ok = [&](int f) { return f >= 0 && f <= t; };
    if (j > 0 && !ok(fin(op, st, j - 1))) return false;  // micro-batch order per stage
    if (op == 0) return st == 0 || ok(fin(0, st - 1, j));
    if (op == 1) return ok(fin(0, st, j)) && (st == S - 1 || ok(fin(1, st + 1, j)));
    return ok(fin(1, st, j));
  };
  const int total = 3 * S * m;
  std::vector<int> held(size_t(s.ranks), 0);
  int placed = 0;
  for (int t = 0; placed < total; ++t) {
    LOOM_CHECK(t <= 4 * total, "pp schedule ", s.name,
               ": the zero-bubble generator made no progress");
    for (int r = 0; r < s.ranks; ++r) {
      const std::vector<int> mine = s.stages_of(r);
      // Candidates in priority order: I (lowest micro-batch, then the later stage), F (same),
      // W (oldest first).
      std::optional<std::tuple<int, int, int>> pick;
      for (int op : {1, 0, 2}) {
        if (op == 0 && held[size_t(r)] >= limit) continue;
        for (int j = 0; j < m && !pick; ++j)
          for (auto it = mine.rbegin(); it != mine.rend() && !pick; ++it)
            if (ready(op, *it, j, t)) pick = std::tuple{op, *it, j};
        if (pick) break;
      }
      if (!pick) continue;
      auto [op, st, j] = *pick;
      done[size_t(op)][size_t(st)][size_t(j)] = t + 1;
      if (op == 0) ++held[size_t(r)];
      if (op == 2) --held[size_t(r)];
      s.orders[size_t(r)].push_back({st, op == 0 ? Op::F : op == 1 ? Op::I : Op::W, j});
      ++placed;
    }
  }
  return s;
}

}  // namespace

std::string to_string(const Action& a) {
  return str_cat(a.stage, op_letter[int(a.op)], a.mb);
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                         ScheduleKind::interleaved_1f1b, ScheduleKind::zb1p, ScheduleKind::zbv})
    if (name == schedule_name(k)) return k;
  fail("parallelism.pp_schedule = \"", name,
       "\": expected gpipe, 1f1b, interleaved_1f1b, zb1p or zbv");
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe:
      return "gpipe";
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::interleaved_1f1b:
      return "interleaved_1f1b";
    case ScheduleKind::zb1p:
      return "zb1p";
    case ScheduleKind::zbv:
      return "zbv";
  }
  return "?";
}

int default_stages_per_rank(ScheduleKind kind) {
  return kind == ScheduleKind::interleaved_1f1b || kind == ScheduleKind::zbv ? 2 : 1;
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int st = 0; st < stages; ++st)
    if (stage_rank[size_t(st)] == rank) out.push_back(st);
  return out;
}

bool Schedule::split_backward() const {
  for (const auto& o : orders)
    for (const Action& a : o)
      if (a.op == Op::I || a.op == Op::W) return true;
  return false;
}

void check_schedule_args(ScheduleKind kind, int p, int v, int m) {
  const char* name = schedule_name(kind);
  LOOM_CHECK(p >= 1, "parallelism.pp = ", p, ": expected a positive integer");
  LOOM_CHECK(m >= 1, "parallelism.pp_microbatches = ", m, ": expected a positive integer");
  LOOM_CHECK(v >= 1, "parallelism.pp_stages_per_rank = ", v, ": expected a positive integer");
  switch (kind) {
    case ScheduleKind::gpipe:
    case ScheduleKind::one_f_one_b:
    case ScheduleKind::zb1p:
      LOOM_CHECK(v == 1, "parallelism.pp_schedule = \"", name, "\" runs one stage per rank: ",
                 "expected parallelism.pp_stages_per_rank = 1, got ", v,
                 " (interleaved_1f1b takes several)");
      break;
    case ScheduleKind::interleaved_1f1b:
      LOOM_CHECK(v >= 2, "parallelism.pp_schedule = \"interleaved_1f1b\" needs ",
                 "parallelism.pp_stages_per_rank >= 2, got ", v, " (1f1b is the v = 1 case)");
      // Megatron's rule: micro-batches go round the ranks in groups of p.
      LOOM_CHECK(m % p == 0, "parallelism.pp_schedule = \"interleaved_1f1b\" sends micro-batches ",
                 "round the ", p, " ranks in groups of parallelism.pp: expected ",
                 "parallelism.pp_microbatches (", m, ") to be a multiple of parallelism.pp (", p,
                 ")");
      break;
    case ScheduleKind::zbv:
      LOOM_CHECK(v == 2, "parallelism.pp_schedule = \"zbv\" places exactly two stages per rank ",
                 "in a V: expected parallelism.pp_stages_per_rank = 2, got ", v);
      break;
  }
  // With fewer micro-batches than ranks a flush schedule can never fill the pipe (torchtitan
  // #775 hung there); refuse it for all but gpipe, which has no steady state to fill.
  if (kind != ScheduleKind::gpipe)
    LOOM_CHECK(m >= p, "parallelism.pp_schedule = \"", name, "\" needs at least one ",
               "micro-batch per rank: expected parallelism.pp_microbatches (", m,
               ") >= parallelism.pp (", p, ")");
}

Schedule make_schedule(ScheduleKind kind, int p, int v, int m) {
  check_schedule_args(kind, p, v, m);
  switch (kind) {
    case ScheduleKind::gpipe: {
      Schedule s = looped("gpipe", p, 1, m);
      for (int r = 0; r < p; ++r) {
        for (int j = 0; j < m; ++j) s.orders[size_t(r)].push_back({r, Op::F, j});
        for (int j = 0; j < m; ++j) s.orders[size_t(r)].push_back({r, Op::B, j});
      }
      return s;
    }
    case ScheduleKind::one_f_one_b: {
      Schedule s = looped("1f1b", p, 1, m);
      for (int r = 0; r < p; ++r)
        s.orders[size_t(r)] = warmup_steady_cooldown(
            m, std::min(m, p - 1 - r),
            [&](int k) {
              return Action{r, Op::F, k};
            },
            [&](int k) {
              return Action{r, Op::B, k};
            });
      return s;
    }
    case ScheduleKind::interleaved_1f1b: {
      // Megatron's interleaved order: the k-th forward of a rank is chunk (k / p) % v of
      // micro-batch (k / pv) p + k % p; backwards visit the chunks in reverse.
      Schedule s = looped("interleaved_1f1b", p, v, m);
      const int total = v * m;
      for (int r = 0; r < p; ++r) {
        auto mb = [&](int k) { return (k / (p * v)) * p + k % p; };
        s.orders[size_t(r)] = warmup_steady_cooldown(
            total, std::min(total, 2 * (p - 1 - r) + (v - 1) * p),
            [&](int k) {
              return Action{((k / p) % v) * p + r, Op::F, mb(k)};
            },
            [&](int k) {
              return Action{(v - 1 - (k / p) % v) * p + r, Op::B, mb(k)};
            });
      }
      return s;
    }
    case ScheduleKind::zb1p: {
      // ZB-H1: 1F1B's order with B split into I and W; rank r defers its first r W's, which
      // fill the cool-down and keep p stage-micro-batches held at most on every rank.
      Schedule s = looped("zb1p", p, 1, m);
      for (int r = 0; r < p; ++r) {
        auto& o = s.orders[size_t(r)];
        const int warmup = std::min(m, p - 1 - r);
        for (int k = 0; k < warmup; ++k) o.push_back({r, Op::F, k});
        int next_w = 0;
        for (int k = 0; k < m; ++k) {
          if (warmup + k < m) o.push_back({r, Op::F, warmup + k});
          o.push_back({r, Op::I, k});
          if (k >= r) o.push_back({r, Op::W, next_w++});
        }
        while (next_w < m) o.push_back({r, Op::W, next_w++});
      }
      return s;
    }
    case ScheduleKind::zbv: {
      Schedule s;
      s.name = "zbv";
      s.ranks = p;
      s.stages = 2 * p;
      s.microbatches = m;
      s.stage_rank.resize(size_t(2 * p));
      for (int r = 0; r < p; ++r) {
        s.stage_rank[size_t(r)] = r;
        s.stage_rank[size_t(2 * p - 1 - r)] = r;
      }
      s.orders.resize(size_t(p));
      return greedy_zero_bubble(std::move(s), 2 * p);
    }
  }
  fail("pp schedule: unknown kind");
}

void validate(const Schedule& s) {
  auto where = [&](int r, size_t k, const Action& a) {
    return str_cat("pp schedule ", s.name, ": rank ", r, ", action ", k, " (", to_string(a), "): ");
  };
  LOOM_CHECK(s.ranks >= 1 && s.microbatches >= 1 && s.stages >= s.ranks, "pp schedule ", s.name,
             ": ", s.ranks, " ranks, ", s.stages, " stages, ", s.microbatches,
             " micro-batches: expected ranks >= 1, stages >= ranks, ", "micro-batches >= 1");
  LOOM_CHECK(int(s.stage_rank.size()) == s.stages && int(s.orders.size()) == s.ranks,
             "pp schedule ", s.name, ": the stage map or the rank lists have the wrong length");
  for (int r = 0; r < s.ranks; ++r)
    LOOM_CHECK(!s.stages_of(r).empty(), "pp schedule ", s.name, ": rank ", r,
               " holds no stage (every rank needs at least one)");
  for (int st = 0; st < s.stages; ++st) {
    const int r = s.stage_rank[size_t(st)];
    LOOM_CHECK(r >= 0 && r < s.ranks, "pp schedule ", s.name, ": stage ", st, " is on rank ", r,
               ", expected 0 <= rank < ", s.ranks);
  }
  const size_t S = size_t(s.stages), M = size_t(s.microbatches);
  // count[op][stage][mb]; next[op][stage]: the micro-batch its next action must have.
  std::vector<std::vector<std::vector<int>>> count(
      4, std::vector<std::vector<int>>(S, std::vector<int>(M, 0)));
  std::vector<std::vector<int>> next(4, std::vector<int>(S, 0));
  for (int r = 0; r < s.ranks; ++r) {
    const auto& order = s.orders[size_t(r)];
    for (size_t k = 0; k < order.size(); ++k) {
      const Action& a = order[k];
      LOOM_CHECK(a.stage >= 0 && size_t(a.stage) < S && a.mb >= 0 && size_t(a.mb) < M,
                 where(r, k, a), "stage or micro-batch out of range (", s.stages, " stages, ",
                 s.microbatches, " micro-batches)");
      LOOM_CHECK(s.stage_rank[size_t(a.stage)] == r, where(r, k, a), "stage ", a.stage,
                 " belongs to rank ", s.stage_rank[size_t(a.stage)]);
      const size_t st = size_t(a.stage), j = size_t(a.mb), op = size_t(a.op);
      LOOM_CHECK(count[op][st][j] == 0, where(r, k, a), "runs twice");
      // B and I are the same step of the backward for ordering purposes.
      const size_t ord = a.op == Op::I ? size_t(Op::B) : op;
      LOOM_CHECK(next[ord][st] == a.mb, where(r, k, a), "out of micro-batch order: stage ", a.stage,
                 " expected micro-batch ", next[ord][st], " next");
      ++next[ord][st];
      auto seen = [&](Op o, size_t stg) { return count[size_t(o)][stg][j] > 0; };
      switch (a.op) {
        case Op::F:
          // A forward from a stage of this same rank must have run before (a V's turn).
          if (st > 0 && s.stage_rank[st - 1] == r)
            LOOM_CHECK(seen(Op::F, st - 1), where(r, k, a), "runs before ", st - 1, "F", j,
                       " on the same rank");
          break;
        case Op::B:
        case Op::I:
          LOOM_CHECK(!seen(a.op == Op::B ? Op::I : Op::B, st), where(r, k, a),
                     "mixes B with I/W for one stage and micro-batch");
          LOOM_CHECK(seen(Op::F, st), where(r, k, a), "runs before its forward ", st, "F", j);
          if (st + 1 < S && s.stage_rank[st + 1] == r)
            LOOM_CHECK(seen(Op::B, st + 1) || seen(Op::I, st + 1), where(r, k, a),
                       "runs before the backward of stage ", st + 1, " on the same rank");
          break;
        case Op::W:
          LOOM_CHECK(seen(Op::I, st), where(r, k, a), "runs before its input gradient ", st, "I",
                     j);
          break;
      }
      ++count[op][st][j];
    }
  }
  for (size_t st = 0; st < S; ++st)
    for (size_t j = 0; j < M; ++j) {
      const auto c = [&](Op o) { return count[size_t(o)][st][j]; };
      LOOM_CHECK(c(Op::F) == 1, "pp schedule ", s.name, ": rank ", s.stage_rank[st],
                 " has no forward ", st, "F", j);
      LOOM_CHECK(c(Op::B) == 1 || (c(Op::I) == 1 && c(Op::W) == 1), "pp schedule ", s.name,
                 ": rank ", s.stage_rank[st], " has no full backward of stage ", st,
                 " micro-batch ", j, " (expected one B, or one I and one W)");
    }
}

}  // namespace loom::pp
