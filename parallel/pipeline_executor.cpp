#include "parallel/pipeline_executor.hpp"

#include <map>
#include <memory>
#include <tuple>

#include "core/error.hpp"
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
};

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
  // The head reads and writes the embedding: on another rank it would read a stale copy and its
  // gradient would never reach the embedding's owner (Megatron sums the two copies; to come).
  LOOM_CHECK(
      !model_.tie_word_embeddings() || schedule_.stage_rank.front() == schedule_.stage_rank.back(),
      "pipeline: the model ties its embeddings (tie_word_embeddings in its config.json) and ",
      "the first and last stages are on different pp ranks; tied embeddings under ",
      "parallelism.pp > 1 are not supported yet");
  // I/W need a backward split into input and weight gradients, which the blocks do not have yet.
  LOOM_CHECK(!schedule_.split_backward(), "parallelism.pp_schedule = \"", schedule_.name,
             "\": zero-bubble schedules (I/W actions) are not supported by the executor yet; ",
             "expected gpipe, 1f1b or interleaved_1f1b");
}

std::vector<size_t> PipelineExecutor::owned_units() const {
  std::vector<size_t> out;
  for (int st : schedule_.stages_of(rank_))
    for (size_t u = units_[size_t(st)].first; u < units_[size_t(st)].second; ++u) out.push_back(u);
  return out;
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

double PipelineExecutor::run(const std::function<PipelineMicroBatch(int)>& batch,
                             float grad_scale) {
  const pp::Schedule& s = schedule_;
  const auto& order = s.orders[size_t(rank_)];
  const int64_t d = model_.hidden_size();
  const bool sp = model_.tp().size() > 1 && model_.tp().sequence_parallel;
  // A micro-batch's store lives from this rank's first forward of it to its last backward.
  std::map<int, std::unique_ptr<ActivationStore>> stores;
  std::map<int, int> pending;  // micro-batch -> this rank's backwards still to run
  std::map<Key, Posted> recvs;
  std::map<Key, Tensor> local;  // handed between two stages of this rank
  std::vector<Posted> sends;
  double loss = 0;

  auto store_of = [&](int mb) -> ActivationStore& {
    auto it = stores.find(mb);
    if (it != stores.end()) return *it->second;
    const PipelineMicroBatch b = batch(mb);
    auto st = std::make_unique<ActivationStore>(
        model_.micro_batch(b.inputs, b.targets, b.B, b.T, grad_scale));
    pending[mb] = int(s.stages_of(rank_).size());
    return *stores.emplace(mb, std::move(st)).first->second;
  };
  auto rows_of = [&](int mb) {
    const PipelineMicroBatch b = batch(mb);
    // The residual stream's rows on this rank (with SP, this tp rank's share of them); the
    // micro-batch's T is already this cp rank's.
    return sp ? b.B * b.T / model_.tp().size() : b.B * b.T;
  };
  auto context = [&](const pp::Action& a, const pp::Message& m, int peer, const char* what) {
    return str_cat("pipeline schedule ", s.name, ", action ", pp::to_string(a), " (stage ", a.stage,
                   ", micro-batch ", a.mb, "): ", what, " ", m.backward ? "gradient" : "activation",
                   " of stage ", m.stage, " with pp rank ", peer, ", tag ",
                   pp::message_tag(m, s.stages, s.microbatches));
  };
  auto post_recvs = [&](size_t k) {
    if (k >= order.size()) return;
    for (const pp::Message& m : pp::inputs_of(s, order[k])) {
      Posted p;
      p.buf = Tensor::empty({rows_of(m.mb), d}, DType::f32, model_.device());
      const int peer = pp::sender_of(s, m);
      p.work = group_->recv(p.buf, peer, pp::message_tag(m, s.stages, s.microbatches));
      p.work->set_context(context(order[k], m, peer, "receiving the"));
      recvs.emplace(key(m), std::move(p));
    }
  };
  auto received = [&](const pp::Action& a, bool backward, int stage) -> Tensor {
    const pp::Message m{backward, stage, a.mb};
    auto lit = local.find(key(m));
    if (lit != local.end()) {
      Tensor t = std::move(lit->second);
      local.erase(lit);
      return t;
    }
    auto it = recvs.find(key(m));
    LOOM_CHECK(it != recvs.end(), "pipeline schedule ", s.name, ": rank ", rank_, " action ",
               pp::to_string(a), " has no ", backward ? "gradient" : "activation",
               " posted for it");
    it->second.work->wait();
    Tensor t = std::move(it->second.buf);
    recvs.erase(it);
    return t;
  };
  auto hand_on = [&](const pp::Action& a, bool backward, int to_stage, Tensor t) {
    const pp::Message m{backward, to_stage, a.mb};
    const int to_rank = s.stage_rank[size_t(to_stage)];
    if (to_rank == rank_) {
      local.emplace(key(m), std::move(t));
      return;
    }
    Posted p;
    pp::Message sent = m;
    if (swap_activations_ && !backward && (a.mb ^ 1) < s.microbatches) sent.mb = a.mb ^ 1;
    p.work = group_->send(t, to_rank, pp::message_tag(sent, s.stages, s.microbatches));
    p.work->set_context(context(a, m, to_rank, "sending the"));
    p.buf = std::move(t);
    sends.push_back(std::move(p));
  };

  if (group_) post_recvs(0);
  for (size_t k = 0; k < order.size(); ++k) {
    if (group_) post_recvs(k + 1);
    const pp::Action& a = order[k];
    if (before_action_) before_action_(a);
    const auto [first, last] = units_[size_t(a.stage)];
    ActivationStore& st = store_of(a.mb);
    if (a.op == pp::Op::F) {
      Tensor x = a.stage > 0 ? received(a, false, a.stage) : Tensor();
      Tensor y = model_.forward(st, first, last, std::move(x));
      if (a.stage + 1 < s.stages) hand_on(a, false, a.stage + 1, std::move(y));
    } else {
      Tensor dy = a.stage + 1 < s.stages ? received(a, true, a.stage) : Tensor();
      Tensor dx = model_.backward(st, first, last, std::move(dy));
      if (a.stage == s.stages - 1) loss += st.loss;
      if (a.stage > 0) hand_on(a, true, a.stage - 1, std::move(dx));
      if (--pending[a.mb] == 0) {
        stores.erase(a.mb);
        pending.erase(a.mb);
      }
    }
    if (after_action_) after_action_();
    // Drive the transfers in flight (Open MPI progresses only inside MPI calls).
    for (auto& p : sends) p.work->test();
  }
  for (auto& p : sends) p.work->wait();
  LOOM_CHECK(recvs.empty() && local.empty() && stores.empty(), "pipeline schedule ", s.name,
             ": rank ", rank_, " ended the step with messages or micro-batches left over");
  return loss;
}

}  // namespace loom
