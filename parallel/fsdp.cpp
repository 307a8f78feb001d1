#include "parallel/fsdp.hpp"

#include "core/error.hpp"
#include "ops/op_count.hpp"
#include "ops/ops.hpp"

namespace loom::parallel {

ReshardPolicy reshard_policy_from_name(const std::string& name) {
  if (name == "default") return ReshardPolicy::by_default;
  if (name == "always") return ReshardPolicy::always;
  if (name == "never") return ReshardPolicy::never;
  fail("parallelism.fsdp_reshard_after_forward = \"", name,
       "\": expected \"default\", \"always\" or \"never\"");
}

struct Fsdp::UnitState {
  std::unique_ptr<dist::Work> gather, side;  // in flight while the weights are being gathered
  std::unique_ptr<dist::Work> reduce;        // the gradient reduce-scatter in flight
  Tensor reduce_in, reduce_out;              // kept alive until `reduce` completes
  uint64_t gather_at = 0, reduce_at = 0;     // ops::ops_run() when each was issued
};

Fsdp::Fsdp(Model& model, dist::ProcessGroup& shard, dist::ProcessGroup* replicate,
           const FsdpConfig& config, dist::ProcessGroup* expert_shard)
    : model_(model),
      units_(model.units()),
      shard_(shard),
      replicate_(replicate),
      config_(config),
      tied_(model.tie_word_embeddings()),
      state_(units_.size()),
      marked_(units_.size(), false),
      prefetch_last_(units_.size()) {
  LOOM_CHECK(config.reduce_dtype == DType::f32 || config.reduce_dtype == DType::bf16,
             "FSDP: reduce dtype must be float32 or bfloat16, got ",
             dtype_name(config.reduce_dtype));
  for (size_t i = 0; i < units_.size(); ++i) {
    const bool experts = model.expert_unit(i);
    LOOM_CHECK(!experts || expert_shard, "FSDP: unit ", units_[i]->name(),
               " holds experts but no expert shard group was given");
    dist::ProcessGroup& g = experts ? *expert_shard : shard;
    groups_.push_back(&g);
    const ParamUnit* u = units_[i];
    LOOM_CHECK(u->shard_layout().count == g.size() && u->shard_layout().rank == g.rank(),
               "FSDP: unit ", u->name(), " is sharded as rank ", u->shard_layout().rank, " of ",
               u->shard_layout().count, " but its shard group is ", g.describe(),
               " with this rank ", g.rank());
  }
  model_.set_hooks(this);
}

Fsdp::~Fsdp() {
  model_.set_hooks(nullptr);
  // Works wait in their destructors: MPI may still write into the buffers they hold.
}

bool Fsdp::reshard_after_forward(size_t unit) const {
  const size_t head = units_.size() - 1;
  if (unit == head || (tied_ && unit == 0)) return false;
  switch (config_.reshard) {
    case ReshardPolicy::always:
      return true;
    case ReshardPolicy::never:
      return false;
    case ReshardPolicy::by_default:
      return unit + 1 != head;  // all but the last block
  }
  return true;
}

void Fsdp::issue_gather(size_t i) {
  ParamUnit& u = *units_[i];
  if (u.weights_materialized()) return;  // ready, or already in flight
  u.materialize_weights();
  UnitState& s = state_[i];
  const Tensor in = u.gather_input();
  s.gather = groups_[i]->all_gather(in, u.full_weights());
  s.gather_at = ops::ops_run();
  if (u.needs_side()) s.side = groups_[i]->all_reduce(u.side_f32(), dist::ReduceOp::sum);
}

void Fsdp::complete_gather(size_t i) {
  state_[i].gather.reset();
  state_[i].side.reset();
  units_[i]->finish_gather();
}

void Fsdp::wait_gather(size_t i) {
  issue_gather(i);
  UnitState& s = state_[i];
  if (!s.gather) return;
  s.gather->wait();
  if (s.side) s.side->wait();
  complete_gather(i);
}

void Fsdp::complete_reduce(size_t i) {
  UnitState& s = state_[i];
  ParamUnit& u = *units_[i];
  s.reduce.reset();
  if (u.device() != Device::elsewhere) {
    Tensor add = s.reduce_out;
    if (add.dtype() != DType::f32) add = add.to(DType::f32);
    Tensor g = u.grad_shard();
    ops::add_inplace(g, add);
  }
  s.reduce_in = s.reduce_out = Tensor();
}

// When a collective completes is the program's choice, not MPI's: at the first hook after an op
// has run since its issue (the unit's compute was its time to overlap), waiting if the network
// is slower. Completing whenever test() first found it done freed its buffers at a time that
// varied from run to run and rank to rank, and the peak with it (by up to 8% on small models);
// now the lifetimes, and the peak, are a function of the layout, and the meta run of the planner
// and pre-flight, which follows the same rule, predicts them exactly. test() still drives the
// others: Open MPI progresses nonblocking collectives only inside MPI calls.
void Fsdp::progress() {
  const uint64_t now = ops::ops_run();
  for (size_t i = 0; i < state_.size(); ++i) {
    UnitState& s = state_[i];
    if (s.gather) {
      s.gather->test();
      if (s.side) s.side->test();
      if (now > s.gather_at) {
        s.gather->wait();
        if (s.side) s.side->wait();
        complete_gather(i);
      }
    }
    if (s.reduce) {
      s.reduce->test();
      if (now > s.reduce_at) {
        s.reduce->wait();
        complete_reduce(i);
      }
    }
  }
}

void Fsdp::before_forward(size_t i) {
  progress();
  wait_gather(i);
  // Not across a pp stage boundary into a unit this rank does not hold (built elsewhere).
  if (i + 1 < prefetch_last_ && model_.uses(i + 1)) issue_gather(i + 1);
}

void Fsdp::after_forward(size_t i) {
  progress();
  if (!keep_gathered_ && reshard_after_forward(i)) units_[i]->release_weights();
}

void Fsdp::before_backward(size_t i) {
  progress();
  wait_gather(i);
  units_[i]->materialize_grads();
  if (tied_ && i + 1 == units_.size()) {
    // The tied output projection reads the embedding's weights and writes its gradient.
    wait_gather(0);
    units_[0]->materialize_grads();
  }
  if (i > prefetch_first_ && model_.uses(i - 1)) issue_gather(i - 1);
}

void Fsdp::after_backward(size_t i) {
  if (defer_reduce_ && !marked_[i]) {
    // Its gradient is not complete yet (a W or a later micro-batch adds to it): kept.
    if (!keep_gathered_) units_[i]->release_weights();
    progress();
    return;
  }
  reduce(i);
}

void Fsdp::reduce(size_t i) {
  ParamUnit& u = *units_[i];
  UnitState& s = state_[i];
  marked_[i] = false;
  LOOM_CHECK(u.grads_materialized(), "FSDP: unit ", u.name(),
             " is to be reduce-scattered but holds no full gradient");
  u.check_grads_written();
  // Whole on this rank (experts on an expert shard group of one): its gradient is complete.
  if (!u.shard_layout().sharded()) return;
  // A unit reduces once per micro-batch (per step under pp's step mode); the previous reduction
  // finished in finish_backward() or complete_pending(), but its buffers must not be overwritten
  // while MPI may still read them.
  if (s.reduce) {
    s.reduce->wait();
    complete_reduce(i);
  }
  const MemoryUseScope use(u.device(), MemoryUse::communication);
  s.reduce_in = config_.reduce_dtype == DType::f32 ? u.grad_flat() : u.grad_flat().to(DType::bf16);
  s.reduce_out = Tensor::empty({u.shard_numel()}, config_.reduce_dtype, u.device());
  s.reduce = groups_[i]->reduce_scatter(s.reduce_in, s.reduce_out, dist::ReduceOp::sum);
  s.reduce_at = ops::ops_run();
  if (!keep_gathered_) u.release_weights();
  u.release_grads();  // the f32 buffer lives on in reduce_in while it is being reduced
  progress();
}

void Fsdp::set_pipeline_mode(bool keep_gathered, bool defer_reduce) {
  keep_gathered_ = keep_gathered;
  defer_reduce_ = defer_reduce;
}

void Fsdp::mark_reduce(size_t unit) {
  marked_[unit] = true;
}

void Fsdp::reduce_marked() {
  for (size_t i = 0; i < units_.size(); ++i)
    if (marked_[i]) reduce(i);
}

void Fsdp::complete_pending() {
  for (size_t i = 0; i < state_.size(); ++i) {
    UnitState& s = state_[i];
    if (s.gather) {
      s.gather->wait();
      if (s.side) s.side->wait();
      complete_gather(i);
    }
    if (s.reduce) {
      s.reduce->wait();
      complete_reduce(i);
    }
  }
}

void Fsdp::release_all_weights() {
  for (ParamUnit* u : units_) u->release_weights();
}

void Fsdp::finish_backward() {
  // A prefetch nobody consumed is completed too (every rank issued it), then freed.
  complete_pending();
  for (size_t i = 0; i < state_.size(); ++i) {
    units_[i]->release_weights();
    units_[i]->release_grads();
    marked_[i] = false;
  }
}

void Fsdp::finish_step() {
  finish_backward();
  if (!replicate_ || replicate_->size() == 1) return;
  std::vector<std::unique_ptr<dist::Work>> works;
  std::vector<Tensor> bufs;
  // A pp rank's units of other stages hold no gradient; the replicas of a shard are all on the
  // same stage, so they skip the same units. (A meta plan of the step still counts every unit it
  // uses.)
  works.resize(units_.size());
  bufs.resize(units_.size());
  for (size_t i = 0; i < units_.size(); ++i) {
    ParamUnit* u = units_[i];
    if (!model_.uses(i)) continue;
    bufs[i] =
        config_.reduce_dtype == DType::f32 ? u->grad_shard() : u->grad_shard().to(DType::bf16);
    works[i] = replicate_->all_reduce(bufs[i], dist::ReduceOp::sum);
  }
  for (size_t i = 0; i < units_.size(); ++i) {
    if (!works[i]) continue;
    works[i]->wait();
    if (bufs[i].dtype() != DType::f32) units_[i]->grad_shard().copy_from(bufs[i].to(DType::f32));
  }
}

Tensor gather_full(dist::ProcessGroup& group, const Tensor& shard) {
  Tensor full = Tensor::empty({shard.numel() * group.size()}, shard.dtype(), shard.device());
  group.all_gather(shard, full)->wait();
  return full;
}

}  // namespace loom::parallel
