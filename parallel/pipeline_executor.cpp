#include "parallel/pipeline_executor.hpp"

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "core/trace.hpp"
#include "ops/ops.hpp"
#include "parallel/pipeline/simulate.hpp"

namespace loom {
namespace {

using Key = std::tuple<bool, int, int>;
Key key(const pp::Message& m) {
  return {m.backward, m.stage, m.mb};
}

struct Posted {
  Tensor buf;
  std::unique_ptr<dist::Work> work;
  pp::Message msg;     // sends: what and to whom, for the trace
  bool carry = false;  // the model's carry beside the message (Model::carry_buffer)
  int peer = -1;
  int tests_left = 0;  // sends: the tests until it is freed (0: at the step's end)
};

// The tags on the pp group, disjoint: the step's activations and gradients [0, 2SM)
// (pp::message_tag), the tied embedding's gradient 2SM, validation's activations 2SM + 1 + stage
// and their carries 2SM + 1 + S + stage, then the step's carries 2SM + 1 + 2S + message_tag. MPI
// keeps the order of messages with one tag between two ranks.
int tied_tag(const pp::Schedule& s) {
  return 2 * s.stages * s.microbatches;
}
int validation_tag(const pp::Schedule& s, int stage, bool carry) {
  return tied_tag(s) + 1 + (carry ? s.stages : 0) + stage;
}
int carry_tag(const pp::Schedule& s, const pp::Message& m) {
  return tied_tag(s) + 1 + 2 * s.stages + pp::message_tag(m, s.stages, s.microbatches);
}

}  // namespace

PipelineExecutor::PipelineExecutor(Model& model, pp::Schedule schedule,
                                   std::vector<pp::UnitRange> stage_units,
                                   dist::ProcessGroup* group)
    : model_(model), schedule_(std::move(schedule)), units_(std::move(stage_units)), group_(group) {
  pp::validate(schedule_);
  const int size = group_ ? group_->size() : 1;
  rank_ = group_ ? group_->rank() : 0;
  LOOM_CHECK(schedule_.ranks == size, "pipeline schedule ", schedule_.name, " is for ",
             schedule_.ranks, " ranks; the pp group has ", size);
  LOOM_CHECK(int(units_.size()) == schedule_.stages, "pipeline schedule ", schedule_.name, " has ",
             schedule_.stages, " stages; the stage split has ", units_.size());
  LOOM_CHECK(units_.front().first == 0 && units_.back().second == model_.num_units(),
             "pipeline: the stages must cover units 0..", model_.num_units());
  // With tied embeddings the last stage's head reads and writes its replica of the embedding (a
  // used unit of the head's rank); sum_tied_gradients() makes the two gradients one, as Megatron
  // does.
  tied_across_ =
      model_.tie_word_embeddings() && schedule_.stage_rank.front() != schedule_.stage_rank.back();
  // A unit this rank runs must be on the model's device: a model built for another rank's stages
  // would give its kernels tensors that are elsewhere.
  auto all = model_.units();
  for (size_t u : used_units())
    LOOM_CHECK(all[u]->device() == model_.device(), "pipeline: pp rank ", rank_, " uses unit ",
               all[u]->name(), " but the model holds it on the ", device_name(all[u]->device()),
               " device, not the model's ", device_name(model_.device()));
  // When a send's buffer is freed is the schedule's choice, not MPI's: at the test after the
  // action where the schedule, simulated with unit costs, has its receiver posted the receive
  // (waiting there if the real receiver is later). Freeing at the first test that found it done
  // made a rank's peak move by a message from run to run; now it is a function of the schedule,
  // and the planner's meta run of this executor predicts it exactly.
  const pp::SimResult sim = pp::simulate(schedule_, pp::unit_costs(1, 2, 1, 1));
  LOOM_CHECK(!sim.deadlock, "pipeline schedule ", schedule_.name, " deadlocks: ", sim.blocked);
  for (const auto& [msg, tests] : sim.send_tests[size_t(rank_)]) send_tests_[key(msg)] = tests;
}

std::vector<size_t> pp_used_units(const pp::Schedule& schedule,
                                  const std::vector<pp::UnitRange>& stage_units, int rank,
                                  bool tie_word_embeddings) {
  std::vector<size_t> out;
  for (int st : schedule.stages_of(rank))
    for (size_t u = stage_units[size_t(st)].first; u < stage_units[size_t(st)].second; ++u)
      out.push_back(u);
  const bool tied_across =
      tie_word_embeddings && schedule.stage_rank.front() != schedule.stage_rank.back();
  const bool head = schedule.stage_rank.back() == rank;
  if (tied_across && head && (out.empty() || out.front() != 0)) out.insert(out.begin(), 0);
  return out;
}

std::vector<size_t> PipelineExecutor::owned_units() const {
  std::vector<size_t> out;
  for (int st : schedule_.stages_of(rank_))
    for (size_t u = units_[size_t(st)].first; u < units_[size_t(st)].second; ++u) out.push_back(u);
  return out;
}

std::vector<size_t> PipelineExecutor::used_units() const {
  return pp_used_units(schedule_, units_, rank_, model_.tie_word_embeddings());
}

std::vector<bool> PipelineExecutor::counted_units() const {
  std::vector<bool> out(model_.num_units(), false);
  for (size_t u : owned_units()) out[u] = true;
  return out;
}

void PipelineExecutor::sum_tied_gradients() {
  if (!tied_across_ || skip_tied_sum_) return;
  const int first = schedule_.stage_rank.front(), last = schedule_.stage_rank.back();
  if (rank_ != first && rank_ != last) return;
  // The embedding's gradient (first stage) and the head's use of it (last stage) are exchanged
  // and added: a + b has the same bits as b + a, so both copies get the same sum, and with the
  // same optimizer state from the same start both apply the same update: the two copies stay
  // equal without broadcasting the weights.
  ParamUnit& emb = *model_.units().front();
  const Tensor g = emb.grad_shard();
  Tensor other = Tensor::empty({g.numel()}, DType::f32, g.device());
  const int peer = rank_ == first ? last : first;
  const int tag = tied_tag(schedule_);
  auto recv = group_->recv(other, peer, tag);
  recv->set_context(str_cat("pipeline schedule ", schedule_.name,
                            ": receiving the tied embedding's gradient from pp rank ", peer));
  auto send = group_->send(g, peer, tag);
  send->set_context(str_cat("pipeline schedule ", schedule_.name,
                            ": sending the tied embedding's gradient to pp rank ", peer));
  recv->wait();
  send->wait();
  Tensor sum = g;
  ops::add_inplace(sum, other);
}

int PipelineExecutor::unit_owner(size_t unit) const {
  for (int st = 0; st < schedule_.stages; ++st)
    if (unit >= units_[size_t(st)].first && unit < units_[size_t(st)].second)
      return schedule_.stage_rank[size_t(st)];
  fail("pipeline: unit ", unit, " is in no stage");
}

bool PipelineExecutor::holds_head() const {
  return schedule_.stage_rank[size_t(schedule_.stages - 1)] == rank_;
}

// One run of the schedule as a state machine: per action, the receives of the next action posted,
// the action run by its method (forward, backward for B and I, weight for W), the sends whose test
// this is freed. The state is what lives between actions: stores, messages, deferred W's.
class PipelineExecutor::Round {
 public:
  Round(PipelineExecutor& ex, const std::function<MicroBatchView(int)>& batch, float grad_scale,
        bool last_round, double loss)
      : ex_(ex),
        s_(ex.schedule_),
        order_(s_.orders[size_t(ex.rank_)]),
        batch_(batch),
        grad_scale_(grad_scale),
        last_round_(last_round),
        loss_(loss),
        d_(ex.model_.hidden_size()),
        sp_(ex.model_.tp().size() > 1 && ex.model_.tp().sequence_parallel),
        bytes0_(ex.group_ ? ex.group_->counters().bytes_sent : 0) {}

  size_t size() const { return order_.size(); }

  // Action k: its inputs were posted one action ahead, so that a transfer overlaps the compute
  // before it.
  void step(size_t k) {
    post_recvs(k + 1);
    const pp::Action& a = order_[k];
    PipelineHooks* hooks = ex_.hooks_.get();
    if (hooks) hooks->before_action(a, last_round_);
    ActivationStore& st = store_of(a.mb);
    if (a.op == pp::Op::F)
      forward(a, st);
    else if (a.op == pp::Op::W)
      weight(a);
    else
      backward(a, st);
    if (a.op == pp::Op::B || a.op == pp::Op::W) release(a.mb);
    if (hooks) hooks->after_action(a, last_round_);
    test_sends();
  }

  void post_recvs(size_t k) {
    if (!ex_.group_ || k >= order_.size()) return;
    for (const pp::Message& m : pp::inputs_of(s_, order_[k])) {
      Posted p;
      const MemoryUseScope use(ex_.model_.device(), MemoryUse::communication);
      p.buf = Tensor::empty({rows_of(m.mb), d_}, DType::f32, ex_.model_.device());
      const int peer = pp::sender_of(s_, m);
      p.work = ex_.group_->recv(p.buf, peer, pp::message_tag(m, s_.stages, s_.microbatches));
      p.work->set_context(context(order_[k], m, peer, "receiving the"));
      recvs_.emplace(key(m), std::move(p));
      Posted c;
      c.buf =
          ex_.drop_backward_carries_ && m.backward ? Tensor() : ex_.model_.carry_buffer(m.backward);
      if (!c.buf.defined()) continue;
      c.work = ex_.group_->recv(c.buf, peer, carry_tag(s_, m));
      c.work->set_context(context(order_[k], m, peer, "receiving the model's carry beside the"));
      carries_.emplace(key(m), std::move(c));
    }
  }

  // The sends still in flight waited for; returns the run's loss.
  double finish() {
    {
      trace::Span w("wait", "sends");
      // The bytes this run sent on the pp group (its counters), which the benchmark compares
      // with the schedule's analytic figure.
      w.arg("count", sends_posted_)
          .arg("p2p_bytes",
               int64_t((ex_.group_ ? ex_.group_->counters().bytes_sent : 0) - bytes0_));
      for (auto& p : sends_) {
        trace::Span sw("wait", str_cat("send ", p.carry          ? "carry"
                                                : p.msg.backward ? "gradient"
                                                                 : "activation"));
        sw.arg("peer", p.peer).arg("stage", p.msg.stage).arg("mb", p.msg.mb);
        p.work->wait();
      }
    }
    LOOM_CHECK(recvs_.empty() && carries_.empty() && local_.empty() && stores_.empty() &&
                   deferred_.empty(),
               "pipeline schedule ", s_.name, ": rank ", ex_.rank_,
               " ended the step with messages or micro-batches left over");
    // The head's losses read back at once, added in the order their backwards ran.
    for (double x : ex_.model_.loss_slots().read(losses_)) loss_ += x;
    return loss_;
  }

 private:
  void forward(const pp::Action& a, ActivationStore& st) {
    const auto [first, last] = ex_.units_[size_t(a.stage)];
    Tensor x = a.stage > 0 ? received(a, false, a.stage, st) : Tensor();
    Tensor y;
    {
      trace::Span sp("action", pp::to_string(a));
      tag(sp, a);
      y = ex_.model_.forward(st, first, last, std::move(x));
    }
    if (a.stage + 1 < s_.stages) hand_on(a, false, a.stage + 1, std::move(y), st);
  }

  // B, or I: the input gradient with every linear layer's dW deferred to this stage's W.
  void backward(const pp::Action& a, ActivationStore& st) {
    const auto [first, last] = ex_.units_[size_t(a.stage)];
    Tensor dy = a.stage + 1 < s_.stages ? received(a, true, a.stage, st) : Tensor();
    Tensor dx;
    {
      trace::Span sp("action", pp::to_string(a));
      tag(sp, a);
      if (a.op == pp::Op::I)
        dx = ex_.model_.backward_input(st, first, last, std::move(dy), deferred_[{a.stage, a.mb}]);
      else
        dx = ex_.model_.backward(st, first, last, std::move(dy));
    }
    if (a.stage == s_.stages - 1) losses_.push_back(st.loss);
    if (a.stage > 0) hand_on(a, true, a.stage - 1, std::move(dx), st);
  }

  // The weight gradients that this stage's I deferred, from its saved operands: no
  // recomputation, and each weight gets the additions of a full backward in the same order.
  void weight(const pp::Action& a) {
    auto it = deferred_.find({a.stage, a.mb});
    LOOM_CHECK(it != deferred_.end(), "pipeline schedule ", s_.name, ": rank ", ex_.rank_,
               " action ", pp::to_string(a), " runs before its I");
    if (ex_.drop_weight_grads_) {
      it->second.clear();
    } else {
      trace::Span sp("action", pp::to_string(a));
      tag(sp, a);
      Model::weight_grads(it->second);
    }
    deferred_.erase(it);
  }

  // A micro-batch's store lives from this rank's first forward of it to its last backward.
  ActivationStore& store_of(int mb) {
    auto it = stores_.find(mb);
    if (it != stores_.end()) return *it->second;
    const MicroBatchView b = batch_(mb);
    auto st = std::make_unique<ActivationStore>(
        ex_.model_.micro_batch(b.inputs, b.targets, b.B, b.T, grad_scale_));
    pending_[mb] = int(s_.stages_of(ex_.rank_).size());
    return *stores_.emplace(mb, std::move(st)).first->second;
  }
  void release(int mb) {
    if (--pending_[mb] > 0) return;
    stores_.erase(mb);
    pending_.erase(mb);
  }

  // The residual stream's rows on this rank (with SP, this tp rank's share of them); the
  // micro-batch's T is already this cp rank's.
  int64_t rows_of(int mb) const {
    const MicroBatchView b = batch_(mb);
    return sp_ ? b.B * b.T / ex_.model_.tp().size() : b.B * b.T;
  }

  std::string context(const pp::Action& a, const pp::Message& m, int peer, const char* what) const {
    return str_cat("pipeline schedule ", s_.name, ", action ", pp::to_string(a), " (stage ",
                   a.stage, ", micro-batch ", a.mb, "): ", what, " ",
                   m.backward ? "gradient" : "activation", " of stage ", m.stage, " with pp rank ",
                   peer, ", tag ", pp::message_tag(m, s_.stages, s_.microbatches));
  }

  // The action's span covers its compute only: the wait for its input is a span of its own, so
  // that the CPU time a trace gives per action is the work (MPI spins while it waits).
  static void tag(trace::Span& sp, const pp::Action& a) {
    const std::string name = pp::to_string(a);
    sp.arg("stage", a.stage)
        .arg("mb", a.mb)
        .arg("kind", name.substr(name.find_first_of("FBIW"), 1));
  }

  // The message's tensor; its carry, if the model has one, given to the micro-batch's store.
  Tensor received(const pp::Action& a, bool backward, int stage, ActivationStore& st) {
    const pp::Message m{backward, stage, a.mb};
    auto lit = local_.find(key(m));
    if (lit != local_.end()) {
      Tensor t = std::move(lit->second);
      local_.erase(lit);
      return t;
    }
    auto it = recvs_.find(key(m));
    LOOM_CHECK(it != recvs_.end(), "pipeline schedule ", s_.name, ": rank ", ex_.rank_, " action ",
               pp::to_string(a), " has no ", backward ? "gradient" : "activation",
               " posted for it");
    {
      trace::Span w("wait", str_cat("recv ", backward ? "gradient" : "activation"));
      w.arg("peer", pp::sender_of(s_, m)).arg("stage", stage).arg("mb", a.mb);
      it->second.work->wait();
    }
    Tensor t = std::move(it->second.buf);
    recvs_.erase(it);
    auto cit = carries_.find(key(m));
    if (cit != carries_.end()) {
      cit->second.work->wait();
      ex_.model_.carry_in(st, backward, cit->second.buf);
      carries_.erase(cit);
    }
    return t;
  }

  // To the next stage: handed over when this rank holds it (the micro-batch's store, and so the
  // model's carry, is the same), else sent with the carry.
  void hand_on(const pp::Action& a, bool backward, int to_stage, Tensor t, ActivationStore& st) {
    const pp::Message m{backward, to_stage, a.mb};
    const int to_rank = s_.stage_rank[size_t(to_stage)];
    if (to_rank == ex_.rank_) {
      local_.emplace(key(m), std::move(t));
      return;
    }
    Posted p;
    pp::Message sent = m;
    if (ex_.swap_activations_ && !backward && (a.mb ^ 1) < s_.microbatches) sent.mb = a.mb ^ 1;
    p.work = ex_.group_->send(t, to_rank, pp::message_tag(sent, s_.stages, s_.microbatches));
    p.work->set_context(context(a, m, to_rank, "sending the"));
    p.buf = std::move(t);
    p.msg = m;
    p.peer = to_rank;
    const auto tests = ex_.send_tests_.find(key(m));
    p.tests_left = tests == ex_.send_tests_.end() ? 0 : tests->second;
    const int tests_left = p.tests_left;
    sends_.push_back(std::move(p));
    ++sends_posted_;
    // The carry goes beside it and is freed at the same test.
    Tensor c;
    if (!(ex_.drop_backward_carries_ && backward)) {
      const MemoryUseScope use(ex_.model_.device(), MemoryUse::communication);
      c = ex_.model_.carry_out(st, backward);
    }
    if (!c.defined()) return;
    Posted q;
    q.work = ex_.group_->send(c, to_rank, carry_tag(s_, sent));
    q.work->set_context(context(a, m, to_rank, "sending the model's carry beside the"));
    q.buf = std::move(c);
    q.msg = m;
    q.carry = true;
    q.peer = to_rank;
    q.tests_left = tests_left;
    sends_.push_back(std::move(q));
  }

  // Drive the transfers in flight (Open MPI progresses only inside MPI calls) and free the
  // buffers whose test this is (send_tests_): kept to the end, a rank would hold every message
  // it sent in the step.
  void test_sends() {
    std::erase_if(sends_, [](Posted& p) {
      p.work->test();
      if (p.tests_left == 0 || --p.tests_left > 0) return false;
      p.work->wait();
      return true;
    });
  }

  PipelineExecutor& ex_;
  const pp::Schedule& s_;
  const std::vector<pp::Action>& order_;
  const std::function<MicroBatchView(int)>& batch_;
  const float grad_scale_;
  const bool last_round_;
  double loss_;
  std::vector<PendingLoss> losses_;  // the head's micro-batches' losses, in backward order
  const int64_t d_;
  const bool sp_;
  const uint64_t bytes0_;
  std::map<int, std::unique_ptr<ActivationStore>> stores_;
  std::map<int, int> pending_;  // micro-batch -> this rank's backwards still to run
  std::map<Key, Posted> recvs_;
  std::map<Key, Posted> carries_;  // the model's carries beside recvs_
  std::map<Key, Tensor> local_;    // handed between two stages of this rank
  std::vector<Posted> sends_;      // not yet freed
  int64_t sends_posted_ = 0;
  std::map<std::pair<int, int>, Model::DeferredWeightGrads> deferred_;  // (stage, mb)
};

double PipelineExecutor::run(const std::function<MicroBatchView(int)>& batch, float grad_scale,
                             double loss, bool last_round) {
  Round round(*this, batch, grad_scale, last_round, loss);
  round.post_recvs(0);
  for (size_t k = 0; k < round.size(); ++k) round.step(k);
  return round.finish();
}

void PipelineExecutor::finish_step() {
  if (hooks_) hooks_->finish_step();
  sum_tied_gradients();
}

double PipelineExecutor::run_forward(const std::function<MicroBatchView(int)>& batch, int n) {
  const pp::Schedule& s = schedule_;
  const int64_t d = model_.hidden_size();
  const bool sp = model_.tp().size() > 1 && model_.tp().sequence_parallel;
  const size_t head = model_.num_units() - 1;
  // Past the training step's activation, gradient and tied-embedding tags; one per stage, and
  // MPI keeps the order of messages with the same tag between two ranks, which is the order both
  // ranks go through the micro-batches.
  std::vector<Posted> sends;
  std::vector<PendingLoss> losses;
  for (int mb = 0; mb < n; ++mb) {
    const MicroBatchView b = batch(mb);
    ActivationStore st = model_.micro_batch(b.inputs, b.targets, b.B, b.T, 0.0f);
    Tensor x;  // the residual stream handed between this rank's consecutive stages
    for (int stage = 0; stage < s.stages; ++stage) {
      if (s.stage_rank[size_t(stage)] != rank_) continue;
      const pp::Action a{stage, pp::Op::F, mb};
      if (hooks_) hooks_->before_action(a, false);
      if (stage > 0 && s.stage_rank[size_t(stage - 1)] != rank_) {
        x = Tensor::empty({sp ? b.B * b.T / model_.tp().size() : b.B * b.T, d}, DType::f32,
                          model_.device());
        const int peer = s.stage_rank[size_t(stage - 1)];
        auto w = group_->recv(x, peer, validation_tag(s, stage, false));
        w->set_context(str_cat("pipeline validation (forward only), stage ", stage,
                               ", micro-batch ", mb, ": receiving the activation from pp rank ",
                               peer));
        Tensor c = model_.carry_buffer(false);
        std::unique_ptr<dist::Work> cw;
        if (c.defined()) {
          cw = group_->recv(c, peer, validation_tag(s, stage, true));
          cw->set_context(str_cat("pipeline validation (forward only), stage ", stage,
                                  ", micro-batch ", mb,
                                  ": receiving the model's carry from pp rank ", peer));
        }
        w->wait();
        if (cw) {
          cw->wait();
          model_.carry_in(st, false, c);
        }
      }
      const auto [first, last] = units_[size_t(stage)];
      Tensor y = model_.forward(st, first, last, std::move(x));
      if (stage + 1 == s.stages) {
        // The head's loss is fused with its backward; its input gradient is dropped.
        model_.backward(st, head, head + 1);
        losses.push_back(st.loss);
      } else if (s.stage_rank[size_t(stage + 1)] == rank_) {
        x = std::move(y);
      } else {
        Posted p;
        const int peer = s.stage_rank[size_t(stage + 1)];
        p.work = group_->send(y, peer, validation_tag(s, stage + 1, false));
        p.work->set_context(str_cat("pipeline validation (forward only), stage ", stage,
                                    ", micro-batch ", mb, ": sending the activation to pp rank ",
                                    peer));
        p.buf = std::move(y);
        sends.push_back(std::move(p));
        Posted c;
        c.buf = model_.carry_out(st, false);
        if (c.buf.defined()) {
          c.work = group_->send(c.buf, peer, validation_tag(s, stage + 1, true));
          c.work->set_context(str_cat("pipeline validation (forward only), stage ", stage,
                                      ", micro-batch ", mb,
                                      ": sending the model's carry to pp rank ", peer));
          sends.push_back(std::move(c));
        }
      }
      if (hooks_) hooks_->after_action(a, false);
      for (auto& p : sends) p.work->test();
    }
  }
  for (auto& p : sends) p.work->wait();
  double loss = 0;
  for (double x : model_.loss_slots().read(losses)) loss += x;
  return loss;
}

}  // namespace loom
