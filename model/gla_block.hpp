#pragma once
// A GLA block (fla's GLABlock: gated linear attention + SwiGLU MLP, pre-norm residuals) with fla's
// parameter names, built from the shared layers as LlamaBlock is. The q, k, v, g and
// gk_proj.0 weights are adjacent in the unit and read as one fused GEMM (spec: they all read the
// normed input). With use_short_conv, q, k and v go through the causal depthwise convolution + SiLU
// before the core. Activation checkpointing: none, full, or op (the norm outputs, the normed
// gated core output and the SwiGLU output are recomputed). Tensor parallelism with or without
// sequence parallelism (heads split over tp ranks, the spec's plan); context parallelism by state
// passing (parallel/layers/gla_state_passing.hpp), the short convolution's halo rows gathered.
#include <cstdint>

#include "core/tensor.hpp"
#include "model/gla_config.hpp"
#include "model/mlp.hpp"
#include "model/param_unit.hpp"
#include "model/step_context.hpp"
#include "parallel/layers/gla_state_passing.hpp"

namespace loom {

// What a GLA block's backward reads.
struct GlaBlockActs {
  Tensor x;       // block input [M, d], in the compute dtype
  Tensor rstd1;   // [M]
  Tensor xn1;     // attention norm output, as the GEMM reads it [M, d]
  Tensor proj;    // q | k | v | g | r [M, Kd + Kd/G + Vd/G + Vd + rank]
  Tensor qkv_c;   // q | k | v after the short convolution (use_short_conv) [M, Kd + Kd/G + Vd/G]
  Tensor r;       // the low-rank gate input, contiguous [M, rank]
  Tensor z;       // gk_proj.1 output before the bias [M, Kd/G]
  Tensor gk;      // log-decay [M, Kd/G]
  Tensor o;       // GLA core output [M, Vd]
  Tensor rstd_o;  // per-head norm [M * H]
  Tensor y;       // normed, gated core output, as o_proj reads it [M, Vd]
  MlpActs mlp;    // from the attention residual h on; gu in f32
  GlaCpSaved cp;  // context parallelism: the segments' decays and starting states
  // Checkpointing leaves some undefined: `full` keeps x only, `op` drops xn1, y, mlp.xn and
  // mlp.act.
  size_t bytes() const;
};

class GlaBlock {
 public:
  // `shard`: the unit's FSDP sharding (its parameters are then views of the gathered weights
  // between the hooks' gather and release).
  GlaBlock(const GlaConfig& c, int64_t layer, bool bf16, Device device,
           const ParallelContext* par = nullptr, ShardLayout shard = {});
  ParamUnit& unit() { return unit_; }
  const ParamUnit& unit() const { return unit_; }
  struct Index;
  const Index& index() const { return ix_; }

  // What forward saves (none, full or op; see ActivationCheckpoint).
  void set_checkpoint(ActivationCheckpoint::Mode mode) { ac_ = mode; }

  // x [M, d] -> output [M, d] (a new tensor); saves into `acts`.
  Tensor forward(const StepContext& ctx, const Tensor& x, GlaBlockActs& acts) const;
  // dy: the gradient w.r.t. the output, turned in place into the gradient w.r.t. the input;
  // parameter gradients accumulate; frees `acts`.
  void backward(const StepContext& ctx, Tensor& dy, GlaBlockActs& acts);

  // fla's numerics: f32 norm, gate/up and SwiGLU outputs, rounded copies for the GEMMs (the
  // model's head, model/head.hpp, likewise); a norm output saved for backward keeps every row
  // under SP.
  static constexpr BranchPrecision kPrecision = BranchPrecision::f32_outputs;

 private:
  struct Dims;
  Dims dims(const StepContext& ctx) const;
  Tensor run_forward(const StepContext& ctx, const Tensor& x, GlaBlockActs& acts) const;
  Mlp mlp(const StepContext& ctx) const;
  const Tensor& weight(int i) const { return unit_.gemm_weight(size_t(i)); }
  // Under cp a segment's convolution reads the previous segment's last conv_size - 1 rows.
  bool conv_halo() const { return par_->cp.size() > 1 && c_.conv_size > 1; }
  Tensor param_or_none(int i) const { return i < 0 ? Tensor() : unit_.params()[size_t(i)].value; }

 public:
  // Indices of the parameters in the unit (-1: absent, e.g. the norm weight without
  // elementwise_affine).
  struct Index {
    int norm1 = -1, q = -1, gk0 = -1, gk1 = -1, gb1 = -1, gnorm = -1, o = -1, conv = -1, norm2 = -1,
        gate = -1, down = -1;  // conv: q_conv1d, then k_conv1d and v_conv1d
  };

 private:
  const GlaConfig& c_;
  const ParallelContext* par_;
  Index ix_;  // before unit_: filled while its specs are made
  ParamUnit unit_;
  ActivationCheckpoint::Mode ac_ = ActivationCheckpoint::Mode::none;
};

}  // namespace loom
