#include "parallel/ddp.hpp"

#include "core/error.hpp"

namespace loom::parallel {

Ddp::Ddp(Model& model, dist::ProcessGroup& dp, DType reduce_dtype)
    : units_(model.units()), dp_(dp), reduce_dtype_(reduce_dtype) {
  LOOM_CHECK(reduce_dtype == DType::f32 || reduce_dtype == DType::bf16,
             "DDP: reduce dtype must be float32 or bfloat16, got ", dtype_name(reduce_dtype));
  for (ParamUnit* u : units_)
    LOOM_CHECK(!u->sharded(), "DDP: unit ", u->name(), " is sharded; DDP replicates parameters");
  work_.resize(units_.size());
  buffer_.resize(units_.size());
  model.set_hooks(this);
}

Ddp::~Ddp() = default;  // Works wait in their destructors

void Ddp::progress() {
  for (auto& w : work_)
    if (w) w->test();
}

void Ddp::before_forward(size_t) {}
void Ddp::after_forward(size_t) {}
void Ddp::before_backward(size_t) {
  progress();
}

void Ddp::after_backward(size_t i) {
  if (sync_) {
    ParamUnit& u = *units_[i];
    if (reduce_dtype_ == DType::f32) {
      work_[i] = dp_.all_reduce(u.grad_flat(), dist::ReduceOp::sum);
    } else {
      buffer_[i] = u.grad_flat().to(DType::bf16);
      work_[i] = dp_.all_reduce(buffer_[i], dist::ReduceOp::sum);
    }
  }
  progress();
}

void Ddp::finish_backward() {
  for (size_t i = 0; i < units_.size(); ++i) {
    if (!work_[i]) continue;
    work_[i]->wait();
    work_[i].reset();
    if (buffer_[i].defined()) {
      units_[i]->grad_flat().copy_from(buffer_[i].to(DType::f32));
      buffer_[i] = Tensor();
    }
  }
}

}  // namespace loom::parallel
