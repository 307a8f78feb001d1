#pragma once
// DDP: replicated (unsharded) parameter units; after each unit's backward an asynchronous
// all-reduce (sum) of its full gradient is issued (a bucket = a unit, so the reduction of unit i
// overlaps the backward of units i-1 .. 0), and finish_backward() waits for all of them before the
// optimizer. Gradients are summed because the trainer already scales each micro-batch by
// 1 / (global samples x seq_len) (see fsdp.hpp). With gradient accumulation only the last
// micro-batch reduces (set_sync(false) for the others), like PyTorch's no_sync().
#include <memory>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/process_group.hpp"
#include "model/model.hpp"

namespace loom::parallel {

class Ddp final : public UnitHooks {
 public:
  Ddp(Model& model, dist::ProcessGroup& dp, DType reduce_dtype);
  ~Ddp() override;
  Ddp(const Ddp&) = delete;
  Ddp& operator=(const Ddp&) = delete;

  void set_sync(bool sync) { sync_ = sync; }  // whether this micro-batch reduces

  void before_forward(size_t unit) override;
  void after_forward(size_t unit) override;
  void before_backward(size_t unit) override;
  void after_backward(size_t unit) override;

  void finish_backward();  // waits for the all-reduces (and casts bf16 results back)

 private:
  void progress();

  std::vector<ParamUnit*> units_;
  dist::ProcessGroup& dp_;
  DType reduce_dtype_;
  bool sync_ = true;
  std::vector<std::unique_ptr<dist::Work>> work_;  // per unit
  std::vector<Tensor> buffer_;                     // per unit: the bf16 copy being reduced
};

}  // namespace loom::parallel
