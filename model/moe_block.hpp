#pragma once
// The transformer block of the mixture-of-experts families (Qwen3-MoE, Mixtral): Llama's
// attention branch (model/attention.hpp; Qwen3's q/k norms as its config says) and, by layer,
// the experts (model/moe_ffn.hpp) or a dense SwiGLU MLP (model/mlp.hpp; Qwen3's
// mlp_only_layers), with Hugging Face's parameter names. Activation checkpointing `full` keeps
// the block's input only; `op` is `none` for the experts' branch (its router state is small
// beside the rows it would recompute).
#include <cstdint>

#include "core/tensor.hpp"
#include "model/attention.hpp"
#include "model/mlp.hpp"
#include "model/moe_config.hpp"
#include "model/moe_ffn.hpp"
#include "model/param_unit.hpp"
#include "model/step_context.hpp"
#include "parallel/layers/activation_checkpoint.hpp"

namespace loom {

// Saved activations of one block.
struct MoeBlockActs {
  AttentionActs attn;
  MlpActs mlp;     // a dense layer's
  MoeFfnActs moe;  // a sparse layer's
  size_t bytes() const { return attn.bytes() + mlp.bytes() + moe.bytes(); }
};

class MoeBlock {
 public:
  MoeBlock(const MoeConfig& c, int64_t layer, bool bf16, Device device, ShardLayout shard = {},
           const ParallelContext* par = nullptr);
  ParamUnit& unit() { return unit_; }
  const ParamUnit& unit() const { return unit_; }
  bool sparse() const { return sparse_; }
  void set_checkpoint(ActivationCheckpoint::Mode mode) { ac_ = mode; }

  // x [M, d] -> output [M, d] (a new tensor); saves into `acts`, the router's statistics into
  // `stats`. In bf16, x is rounded to bf16 in place.
  Tensor forward(const StepContext& ctx, const Tensor& x, MoeBlockActs& acts,
                 RouterStats& stats) const;
  // dy [M, d] is turned in place into the gradient w.r.t. the block's input; parameter gradients
  // accumulate (the auxiliary loss's through stats.dprob). Recomputes what forward did not save,
  // then frees `acts`.
  void backward(const StepContext& ctx, Tensor& dy, MoeBlockActs& acts, RouterStats& stats);

  static constexpr BranchPrecision kPrecision = BranchPrecision::rounded_outputs;

 private:
  Tensor run_forward(const StepContext& ctx, const Tensor& x, MoeBlockActs& a,
                     ActivationCheckpoint::Mode mode, bool output, RouterStats& stats,
                     bool round_input = false) const;
  Attention attention(const StepContext& ctx) const;
  Mlp mlp(const StepContext& ctx) const;
  MoeFfn moe(const StepContext& ctx) const;

  const MoeConfig& c_;
  const ParallelContext* par_;
  bool sparse_;
  size_t norm2_;  // the index of post_attention_layernorm; the branch's parameters follow it
  ParamUnit unit_;
  ActivationCheckpoint::Mode ac_ = ActivationCheckpoint::Mode::none;
};

}  // namespace loom
