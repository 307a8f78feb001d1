#include "parallel/pipeline_fsdp.hpp"

#include "core/error.hpp"

namespace loom {

PpFsdpGather pp_fsdp_gather_from_name(const std::string& name) {
  if (name == "microbatch") return PpFsdpGather::microbatch;
  if (name == "step") return PpFsdpGather::step;
  fail("parallelism.pp_fsdp_gather = \"", name, "\": expected \"microbatch\" or \"step\"");
}

std::vector<size_t> pp_grad_units(const std::vector<pp::UnitRange>& stage_units, int stage,
                                  size_t num_units, bool tie_word_embeddings) {
  const auto [first, last] = stage_units[size_t(stage)];
  std::vector<size_t> out;
  // The head's tied projection writes the embedding's gradient (model/model.hpp, UnitHooks).
  if (tie_word_embeddings && last == num_units && first > 0) out.push_back(0);
  for (size_t u = first; u < last; ++u) out.push_back(u);
  return out;
}

std::vector<std::vector<size_t>> pp_fsdp_reduce_plan(const pp::Schedule& schedule,
                                                     const std::vector<pp::UnitRange>& stage_units,
                                                     int rank, size_t num_units,
                                                     bool tie_word_embeddings, PpFsdpGather mode) {
  const auto& order = schedule.orders[size_t(rank)];
  std::vector<std::vector<size_t>> plan(order.size());
  if (mode == PpFsdpGather::step) {
    // After the step's last action that writes the unit's gradient (a W writes the linear layers'
    // weight gradients its I deferred).
    std::vector<int64_t> last(num_units, -1);
    for (size_t k = 0; k < order.size(); ++k)
      if (order[k].op != pp::Op::F)
        for (size_t u : pp_grad_units(stage_units, order[k].stage, num_units, tie_word_embeddings))
          last[u] = int64_t(k);
    for (size_t u = 0; u < num_units; ++u)
      if (last[u] >= 0) plan[size_t(last[u])].push_back(u);
    return plan;
  }
  // Per micro-batch: after a B, or after a W once no I that wrote the unit awaits its W (a
  // zero-bubble rank may run I of several micro-batches of a stage before their W's, all adding
  // into the one full gradient; reduced earlier, a later W would add to a freed buffer).
  std::vector<int> pending(num_units, 0);
  for (size_t k = 0; k < order.size(); ++k) {
    const pp::Action& a = order[k];
    if (a.op == pp::Op::F) continue;
    for (size_t u : pp_grad_units(stage_units, a.stage, num_units, tie_word_embeddings)) {
      if (a.op == pp::Op::I) {
        ++pending[u];
        continue;
      }
      if (a.op == pp::Op::W) --pending[u];
      if (pending[u] == 0) plan[k].push_back(u);
    }
  }
  return plan;
}

namespace {

std::vector<pp::UnitRange> ranges_of(const PipelineExecutor& pipe) {
  std::vector<pp::UnitRange> out;
  for (int st = 0; st < pipe.schedule().stages; ++st) out.push_back(pipe.stage_units(st));
  return out;
}

}  // namespace

PipelineFsdp::PipelineFsdp(const PipelineExecutor& pipe, parallel::Fsdp& fsdp, size_t num_units,
                           bool tie_word_embeddings, PpFsdpGather mode)
    : pipe_(pipe), fsdp_(fsdp), step_(mode == PpFsdpGather::step) {
  fsdp_.set_pipeline_mode(step_, true);
  const pp::Schedule& s = pipe.schedule();
  const auto plan =
      pp_fsdp_reduce_plan(s, ranges_of(pipe), pipe.rank(), num_units, tie_word_embeddings, mode);
  const auto& order = s.orders[size_t(pipe.rank())];
  for (size_t k = 0; k < order.size(); ++k)
    if (!plan[k].empty()) due_[{order[k].stage, int(order[k].op), order[k].mb}] = plan[k];
}

void PipelineFsdp::before_action(const pp::Action& a, bool last_round) {
  const auto [first, last] = pipe_.stage_units(a.stage);
  fsdp_.set_prefetch_range(first, last);
  if (step_ && !last_round) return;
  auto it = due_.find({a.stage, int(a.op), a.mb});
  if (it == due_.end()) return;
  for (size_t u : it->second) fsdp_.mark_reduce(u);
}

void PipelineFsdp::after_action(const pp::Action&, bool) {
  fsdp_.reduce_marked();
  fsdp_.complete_pending();
  if (!step_) fsdp_.release_all_weights();
}

}  // namespace loom
