#include "parallel/pipeline/simulate.hpp"

#include <algorithm>
#include <map>
#include <tuple>

#include "core/error.hpp"

namespace loom::pp {
namespace {

using Key = std::tuple<bool, int, int>;
Key key(const Message& m) {
  return {m.backward, m.stage, m.mb};
}

std::string describe(const Message& m) {
  return str_cat(m.backward ? "gradient into stage " : "activation into stage ", m.stage,
                 " of micro-batch ", m.mb);
}

// Each rank's peak bytes under `mem`: its lowered ops walked in order with the times the sweep gave
// them; a send's buffer is freed at the first test (the end of an action, its own sends posted)
// later than its transfer's completion.
std::vector<double> peak_bytes(const Schedule& s,
                               const std::vector<std::vector<LoweredOp>>& lowered,
                               const std::vector<std::vector<double>>& at,
                               const std::map<Key, double>& send_posted,
                               const std::map<Key, double>& recv_posted, double comm,
                               const MemoryModel& mem) {
  LOOM_CHECK(int(mem.stages.size()) == s.stages, "pipeline memory model: ", mem.stages.size(),
             " stages for a schedule of ", s.stages);
  const double msg = mem.message;
  std::vector<double> out;
  for (size_t r = 0; r < lowered.size(); ++r) {
    const auto& ops = lowered[r];
    double held = 0, peak = 0;
    std::vector<double> in_flight;  // completion times of the sends whose buffers are still held
    for (size_t k = 0; k < ops.size(); ++k) {
      const LoweredOp& op = ops[k];
      if (op.step == Step::post_recv) {
        held += msg;
      } else if (op.step == Step::compute) {
        const Action& a = op.action;
        const StageBytes& b = mem.stages[size_t(a.stage)];
        const bool first = a.stage == 0, last = a.stage + 1 == s.stages;
        if (a.op == Op::F) {
          // The input (a message's buffer) becomes saved; the output is a new message.
          held += b.saved - (first ? 0 : msg) + (last ? 0 : msg);
          peak = std::max(peak, held + b.forward);
        } else if (a.op == Op::W) {
          held -= b.deferred;
        } else {
          peak = std::max(peak, held + (a.op == Op::I ? b.input : b.backward));
          // The head makes the gradient, the embedding drops it; between, it is the input's.
          held +=
              -b.saved + (a.op == Op::I ? b.deferred : 0) + (last ? msg : 0) - (first ? msg : 0);
        }
      } else if (op.step == Step::post_send) {
        in_flight.push_back(std::max(send_posted.at(key(op.msg)), recv_posted.at(key(op.msg))) +
                            comm);
      } else if (op.step == Step::wait_sends) {
        held -= msg * double(in_flight.size());
        in_flight.clear();
      }
      peak = std::max(peak, held);
      const bool action_done = (op.step == Step::compute || op.step == Step::post_send) &&
                               (k + 1 == ops.size() || ops[k + 1].step != Step::post_send);
      if (action_done) {
        const double now = at[r][k];
        const auto kept =
            std::remove_if(in_flight.begin(), in_flight.end(), [&](double c) { return c < now; });
        held -= msg * double(in_flight.end() - kept);
        in_flight.erase(kept, in_flight.end());
      }
    }
    out.push_back(peak);
  }
  return out;
}

// Each rank's sends and the test that frees each (SimResult::send_tests): the walk of peak_bytes,
// counting the tests instead of bytes.
std::vector<std::vector<std::pair<Message, int>>> send_tests(
    const std::vector<std::vector<LoweredOp>>& lowered, const std::vector<std::vector<double>>& at,
    const std::map<Key, double>& send_posted, const std::map<Key, double>& recv_posted,
    double comm) {
  std::vector<std::vector<std::pair<Message, int>>> out(lowered.size());
  for (size_t r = 0; r < lowered.size(); ++r) {
    const auto& ops = lowered[r];
    struct Pending {
      size_t index;       // into out[r]
      double completion;  // when both sides are posted, plus the transfer
    };
    std::vector<Pending> pending;
    for (size_t k = 0; k < ops.size(); ++k) {
      const LoweredOp& op = ops[k];
      if (op.step == Step::post_send) {
        pending.push_back(
            {out[r].size(),
             std::max(send_posted.at(key(op.msg)), recv_posted.at(key(op.msg))) + comm});
        out[r].push_back({op.msg, 0});
      }
      const bool action_done = (op.step == Step::compute || op.step == Step::post_send) &&
                               (k + 1 == ops.size() || ops[k + 1].step != Step::post_send);
      if (!action_done) continue;
      const double now = at[r][k];
      // Every pending send is tested once more; those complete before now are freed.
      std::erase_if(pending, [&](const Pending& p) {
        ++out[r][p.index].second;
        return p.completion < now;
      });
    }
    for (const Pending& p : pending) out[r][p.index].second = 0;
  }
  return out;
}

}  // namespace

int message_tag(const Message& msg, int stages, int microbatches) {
  return (int(msg.backward) * stages + msg.stage) * microbatches + msg.mb;
}

int sender_of(const Schedule& s, const Message& m) {
  return s.stage_rank[size_t(m.backward ? m.stage + 1 : m.stage - 1)];
}
int receiver_of(const Schedule& s, const Message& m) {
  return s.stage_rank[size_t(m.stage)];
}

std::vector<Message> inputs_of(const Schedule& s, const Action& a) {
  const int r = s.stage_rank[size_t(a.stage)];
  if (a.op == Op::F && a.stage > 0 && s.stage_rank[size_t(a.stage - 1)] != r)
    return {{false, a.stage, a.mb}};
  if ((a.op == Op::B || a.op == Op::I) && a.stage + 1 < s.stages &&
      s.stage_rank[size_t(a.stage + 1)] != r)
    return {{true, a.stage, a.mb}};
  return {};
}

std::vector<Message> outputs_of(const Schedule& s, const Action& a) {
  const int r = s.stage_rank[size_t(a.stage)];
  if (a.op == Op::F && a.stage + 1 < s.stages && s.stage_rank[size_t(a.stage + 1)] != r)
    return {{false, a.stage + 1, a.mb}};
  if ((a.op == Op::B || a.op == Op::I) && a.stage > 0 && s.stage_rank[size_t(a.stage - 1)] != r)
    return {{true, a.stage - 1, a.mb}};
  return {};
}

std::vector<std::vector<LoweredOp>> lower(const Schedule& s) {
  std::vector<std::vector<LoweredOp>> out(size_t(s.ranks));
  for (int r = 0; r < s.ranks; ++r) {
    const auto& order = s.orders[size_t(r)];
    auto& ops = out[size_t(r)];
    auto post_recvs = [&](size_t k) {
      if (k >= order.size()) return;
      for (const Message& m : inputs_of(s, order[k]))
        ops.push_back({Step::post_recv, order[k], m, sender_of(s, m)});
    };
    post_recvs(0);
    for (size_t k = 0; k < order.size(); ++k) {
      post_recvs(k + 1);  // one action ahead: the transfer overlaps this action's compute
      for (const Message& m : inputs_of(s, order[k]))
        ops.push_back({Step::wait_recv, order[k], m, sender_of(s, m)});
      ops.push_back({Step::compute, order[k], {}, -1});
      for (const Message& m : outputs_of(s, order[k]))
        ops.push_back({Step::post_send, order[k], m, receiver_of(s, m)});
    }
    ops.push_back({Step::wait_sends, {}, {}, -1});
  }
  return out;
}

ActionCost unit_costs(double f, double b, double i, double w) {
  return [=](const Action& a) {
    switch (a.op) {
      case Op::F:
        return f;
      case Op::B:
        return b;
      case Op::I:
        return i;
      case Op::W:
        return w;
    }
    return 0.0;
  };
}

double SimResult::bubble() const {
  double busy_sum = 0;
  for (double b : busy) busy_sum += b;
  const double total = double(busy.size()) * makespan;
  return total > 0 ? 1 - busy_sum / total : 0;
}

SimResult simulate(const Schedule& s, const ActionCost& cost, double comm,
                   const MemoryModel* memory) {
  const auto lowered = lower(s);
  const size_t P = size_t(s.ranks);
  std::map<Key, double> send_posted, recv_posted;
  std::vector<size_t> pc(P, 0);
  std::vector<double> t(P, 0);
  std::vector<std::vector<Message>> my_sends(P);
  std::vector<int> held(P, 0);
  std::vector<std::vector<double>> at(P);  // per rank, the time after each lowered op
  SimResult res;
  res.busy.assign(P, 0);
  res.peak_held.assign(P, 0);
  res.sends.assign(P, 0);
  // Every rank runs as far as it can; a wait whose other side is not posted yet stops it until a
  // later sweep. Times are maxima over causes that are final once posted, so the sweep order does
  // not change them.
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < P; ++r) {
      const auto& ops = lowered[r];
      for (; pc[r] < ops.size(); ++pc[r], progress = true) {
        const LoweredOp& op = ops[pc[r]];
        if (op.step == Step::post_recv) {
          recv_posted[key(op.msg)] = t[r];
        } else if (op.step == Step::wait_recv) {
          auto it = send_posted.find(key(op.msg));
          if (it == send_posted.end()) break;
          t[r] = std::max(t[r], std::max(it->second, recv_posted.at(key(op.msg))) + comm);
        } else if (op.step == Step::compute) {
          const double c = cost(op.action);
          t[r] += c;
          res.busy[r] += c;
          if (op.action.op == Op::F) res.peak_held[r] = std::max(res.peak_held[r], ++held[r]);
          if (op.action.op == Op::B || op.action.op == Op::W) --held[r];
        } else if (op.step == Step::post_send) {
          send_posted[key(op.msg)] = t[r];
          my_sends[r].push_back(op.msg);
          ++res.sends[r];
        } else {  // wait_sends
          bool all = true;
          double end = t[r];
          for (const Message& m : my_sends[r]) {
            auto it = recv_posted.find(key(m));
            if (it == recv_posted.end()) {
              all = false;
              break;
            }
            end = std::max(end, std::max(send_posted.at(key(m)), it->second) + comm);
          }
          if (!all) break;
          t[r] = end;
        }
        at[r].push_back(t[r]);
      }
    }
  }
  for (size_t r = 0; r < P; ++r) {
    if (pc[r] == lowered[r].size()) continue;
    res.deadlock = true;
    const LoweredOp& op = lowered[r][pc[r]];
    res.blocked += str_cat("rank ", r, " at step ", pc[r], " (", to_string(op.action), ") waits ",
                           op.step == Step::wait_recv
                               ? str_cat("for the ", describe(op.msg), " from rank ", op.peer)
                               : std::string("for its sends to be received"),
                           "; ");
  }
  res.makespan = *std::max_element(t.begin(), t.end());
  for (size_t r = 0; r < P; ++r) res.idle.push_back(res.makespan - res.busy[r]);
  if (!res.deadlock) res.send_tests = send_tests(lowered, at, send_posted, recv_posted, comm);
  if (memory && !res.deadlock)
    res.peak_bytes = peak_bytes(s, lowered, at, send_posted, recv_posted, comm, *memory);
  return res;
}

}  // namespace loom::pp
