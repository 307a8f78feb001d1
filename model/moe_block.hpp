#pragma once
// The layers of the mixture-of-experts families (Qwen3-MoE, Mixtral), each one or two of the
// model's blocks, with Hugging Face's parameter names:
// - MoeAttentionBlock (unit "layers.L"): Llama's attention branch (model/attention.hpp; Qwen3's
//   q/k norms as the config says), then a dense SwiGLU MLP (model/mlp.hpp; Qwen3's
//   mlp_only_layers) or, in a sparse layer, the router half of the experts' branch
//   (model/moe_ffn.hpp: norm, router, the tokens grouped by expert, handed on in MoeRouting);
// - MoeExpertsBlock (unit "layers.L.experts", sparse layers only): the experts, alone in their unit
//   so that expert parallelism can shard them over another group than the rest.
// Activation checkpointing `full`: the attention block keeps its input (and a sparse layer's
// routing, which the experts block reads before the attention block's backward recomputes), the
// experts block keeps nothing (its backward routes the rows through the experts again); `op` is
// `none` for both halves of the experts' branch.
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

// The tp ranks a layer splits over (1 without tensor parallelism).
int tp_size(const ParallelContext& par);
// The experts each rank holds and computes, E / (ep x tp), and the first one's global index: ep
// rank j holds experts [j E/ep, (j + 1) E/ep), divided over its tp ranks in rank order.
int64_t local_experts(const MoeConfig& c, const ParallelContext& par);
int64_t first_expert(const MoeConfig& c, const ParallelContext& par);

// Saved activations of an attention block.
struct MoeAttentionActs {
  AttentionActs attn;
  MlpActs mlp;         // a dense layer's
  MoeRouting routing;  // a sparse layer's
  size_t bytes() const { return attn.bytes() + mlp.bytes() + routing.bytes(); }
};

class MoeAttentionBlock {
 public:
  MoeAttentionBlock(const MoeConfig& c, int64_t layer, bool bf16, Device device,
                    ShardLayout shard = {}, const ParallelContext* par = nullptr);
  ParamUnit& unit() { return unit_; }
  bool sparse() const { return sparse_; }
  // A sparse layer's selection-only bias (MoeConfig::expert_bias): its index in unit().
  size_t bias_param() const;
  void set_checkpoint(ActivationCheckpoint::Mode mode) { ac_ = mode; }

  // x [M, d] -> the dense layer's output, or a sparse layer's attention residual h (which the
  // experts block adds its branch to; acts.routing holds the router's decisions). The router's
  // statistics go to `stats`. In bf16, x is rounded to bf16 in place.
  Tensor forward(const StepContext& ctx, const Tensor& x, MoeAttentionActs& acts,
                 RouterStats& stats) const;
  // dy [M, d] (w.r.t. the block's output; a sparse layer's: w.r.t. the experts block's, after its
  // backward set acts.routing.dxn and dweights) -> w.r.t. the block's input, in place; parameter
  // gradients accumulate. Then frees `acts`.
  void backward(const StepContext& ctx, Tensor& dy, MoeAttentionActs& acts,
                const RouterStats& stats);

  static constexpr BranchPrecision kPrecision = BranchPrecision::rounded_outputs;

  // The branches on a micro-batch of `ctx` (public: the inference path runs them too, on its
  // chunk of tokens).
  Attention attention(const StepContext& ctx) const;
  Mlp mlp(const StepContext& ctx) const;
  MoeRouter router(const StepContext& ctx) const;

 private:
  Tensor run_forward(const StepContext& ctx, const Tensor& x, MoeAttentionActs& a,
                     ActivationCheckpoint::Mode mode, bool output, RouterStats* stats,
                     bool round_input = false) const;

  const MoeConfig& c_;
  const ParallelContext* par_;
  bool sparse_;
  size_t norm2_;  // the index of post_attention_layernorm; the MLP's or router's follow it
  ParamUnit unit_;
  ActivationCheckpoint::Mode ac_ = ActivationCheckpoint::Mode::none;
};

class MoeExpertsBlock {
 public:
  // With expert parallelism (par->ep) the unit holds this ep rank's E / ep experts (their global
  // names), sharded by par->ep.shard; under tp this tp rank's slice of them (first_expert).
  MoeExpertsBlock(const MoeConfig& c, int64_t layer, bool bf16, Device device,
                  ShardLayout shard = {}, const ParallelContext* par = nullptr);
  ParamUnit& unit() { return unit_; }
  void set_checkpoint(ActivationCheckpoint::Mode mode) { ac_ = mode; }

  // h (the attention block's output) -> h + the experts' branch, from `routing`.
  Tensor forward(const StepContext& ctx, const MoeRouting& routing, MoeExpertsActs& acts) const;
  // dy passes through to h unchanged; sets routing.dxn and routing.dweights for the router's
  // backward; parameter gradients accumulate. Recomputes what forward did not save, then frees
  // `acts`.
  void backward(const StepContext& ctx, const Tensor& dy, MoeRouting& routing,
                MoeExpertsActs& acts);
  // The experts' branch on a micro-batch of `ctx` (public: the inference path runs it too).
  MoeExperts experts(const StepContext& ctx) const;

 private:
  const MoeConfig& c_;
  const ParallelContext* par_;
  ParamUnit unit_;
  ActivationCheckpoint::Mode ac_ = ActivationCheckpoint::Mode::none;
};

}  // namespace loom
