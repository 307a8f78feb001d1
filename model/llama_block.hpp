#pragma once
// Llama's transformer block (attention + SwiGLU MLP, pre-norm residuals) composed of the parallel
// layers: column-parallel q/k/v and gate/up, row-parallel o and down (tensor parallelism, with
// sequence parallelism outside attention), ring attention (context parallelism) and activation
// checkpointing. Each forward saves exactly what its backward needs in the micro-batch's
// LlamaBlockActs; backward returns the input gradient and accumulates parameter gradients.
#include <cstdint>

#include "core/tensor.hpp"
#include "model/attention.hpp"
#include "model/llama_config.hpp"
#include "model/mlp.hpp"
#include "model/param_unit.hpp"
#include "model/step_context.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/activation_checkpoint.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

// Indices of a block's parameters in its unit: q, k, v adjacent (read as one fused GEMM
// matrix), gate and up adjacent (likewise).
enum BlockParam { kNorm1, kQ, kK, kV, kO, kNorm2, kGate, kUp, kDown };

// Saved activations of one Llama block.
struct LlamaBlockActs {
  AttentionActs attn;  // from the block's input x on
  MlpActs mlp;         // from the attention residual h on; gu and act in the compute dtype
  // Checkpointing leaves some undefined: `full` keeps attn.x only, `op` drops attn.xn1, mlp.xn and
  // mlp.act.
  size_t bytes() const { return attn.bytes() + mlp.bytes(); }
};

class LlamaBlock {
 public:
  LlamaBlock(const LlamaConfig& c, int64_t layer, bool bf16, Device device, ShardLayout shard = {},
             const ParallelContext* par = nullptr);
  ParamUnit& unit() { return unit_; }
  const ParamUnit& unit() const { return unit_; }
  // What forward saves (none, full or op; see ActivationCheckpoint).
  void set_checkpoint(ActivationCheckpoint::Mode mode) { ac_ = mode; }

  // x [M, d] -> output [M, d] (a new tensor); saves into `acts`. With sequence parallelism x and
  // the output hold this tp rank's M / tp rows. In bf16, x is rounded to bf16 in place.
  Tensor forward(const StepContext& ctx, const Tensor& x, LlamaBlockActs& acts) const;
  // dy [M, d] (gradient w.r.t. the block's output) is turned in place into the gradient w.r.t.
  // the block's input; parameter gradients accumulate. Recomputes what forward did not save
  // (with tp or cp that re-runs their communication), then frees `acts`.
  void backward(const StepContext& ctx, Tensor& dy, LlamaBlockActs& acts);

  // The norms, GEMMs and SwiGLU write the compute dtype themselves (no f32 copies); the model's
  // head (model/head.hpp) runs at the same precision.
  static constexpr BranchPrecision kPrecision = BranchPrecision::rounded_outputs;

 private:
  // `mode` says what to keep in `acts`; without `output` the down projection is skipped (the
  // recomputation of a `full` block needs everything but the output) and an empty tensor
  // returned. With `round_input` (bf16's forward) the first norm also rounds x in place and into
  // acts.attn.x, allocated by the caller.
  Tensor run_forward(const StepContext& ctx, const Tensor& x, LlamaBlockActs& acts,
                     ActivationCheckpoint::Mode mode, bool output, bool round_input = false) const;
  Attention attention(const StepContext& ctx) const;
  Mlp mlp(const StepContext& ctx) const;

  const LlamaConfig& c_;
  const ParallelContext* par_;
  ParamUnit unit_;
  ActivationCheckpoint::Mode ac_ = ActivationCheckpoint::Mode::none;
};

}  // namespace loom
