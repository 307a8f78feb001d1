#include "parallel/pipeline_ddp.hpp"

namespace loom {

PipelineDdp::PipelineDdp(const PipelineExecutor& pipe, parallel::Ddp& ddp, Model& model,
                         dist::ProcessGroup& dp)
    : pipe_(pipe),
      ddp_(ddp),
      model_(model),
      dp_(dp),
      last_mb_(pipe.schedule().microbatches - 1),
      zb_(pipe.schedule().split_backward()) {}

void PipelineDdp::before_action(const pp::Action& a, bool last_round) {
  ddp_.set_sync(!zb_ && last_round && a.op == pp::Op::B && a.mb == last_mb_);
}

void PipelineDdp::after_action(const pp::Action& a, bool last_round) {
  if (!zb_ || !last_round || a.op != pp::Op::W || a.mb != last_mb_) return;
  const auto [first, end] = pipe_.stage_units(a.stage);
  ddp_.set_sync(true);
  for (size_t u = end; u-- > first;) ddp_.after_backward(u);
  ddp_.set_sync(false);
}

void PipelineDdp::finish_step() {
  // DDP reduced the first stage's embedding in its hooks; the last stage's replica never ran them.
  if (pipe_.tied_across_ranks() && pipe_.holds_head())
    dp_.all_reduce(model_.units().front()->grad_flat(), dist::ReduceOp::sum)->wait();
}

}  // namespace loom
