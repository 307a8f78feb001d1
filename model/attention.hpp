#pragma once
// The causal self-attention branch of a pre-norm block, shared by the families with softmax
// attention (Llama's block, the MoE families' block): h = x + o(attention(rope(qkv(norm(x))))),
// q, k, v one fused column-parallel GEMM, o row-parallel (tensor parallelism; with sequence
// parallelism x and h hold this tp rank's rows), ring attention across cp ranks. Qwen3's q/k norms
// (an RMSNorm over head_dim per head of q and of k, before RoPE) and Qwen2's q/k/v projection
// biases are options. Forward beside
// backward; what the backward reads is saved in the block's AttentionActs.
#include <cstddef>
#include <cstdint>

#include "core/tensor.hpp"
#include "model/norm_input.hpp"
#include "model/param_unit.hpp"
#include "model/step_context.hpp"
#include "parallel/layers/activation_checkpoint.hpp"

namespace loom {

// What the branch's backward reads.
struct AttentionActs {
  Tensor x;      // the block's input [Mx, d], in the compute dtype
  Tensor rstd1;  // [Mx]
  Tensor xn1;    // the norm output, as the GEMM reads it [M, d]
  Tensor qkv;    // after RoPE [M, (Hq + 2 Hkv) hd], in the compute dtype
  Tensor attn;   // attention output [M, Hq hd], in the compute dtype
  Tensor lse;    // [B, Hq, T]
  // With q/k norms: q and k before their norms [M, (Hq + Hkv) hd] f32, and the norms' rstd
  // [M (Hq + Hkv)].
  Tensor qk, qk_rstd;
  size_t bytes() const;
};

// The branch as a block runs it on one micro-batch: its parameters' indices in the block's unit
// and this tp rank's sizes.
struct Attention {
  const ParallelContext& par;
  size_t norm, q, o;  // q: the first of the fused q/k/v matrix (k and v follow it)
  // q/k norms: the index of q_norm (k_norm follows it); kNone without.
  static constexpr size_t kNone = size_t(-1);
  size_t qk_norm = kNone;
  // q/k/v biases: the index of q_proj.bias (k's and v's follow it); kNone without.
  size_t qkv_bias = kNone;
  int64_t M, Mx, d, hd, Hq, Hkv;  // rows (Mx: of x, M / tp under SP), this rank's heads
  float eps;
  DType compute;
  // Whether a norm output saved by a forward that keeps everything holds every row under SP
  // (else the backward gathers it again: recompute_allgather).
  bool keep_gathered;

  // Its rows and heads on this tp rank for a micro-batch of `ctx`.
  static Attention of(const ParallelContext& par, const StepContext& ctx, size_t norm, size_t q,
                      size_t o, size_t qk_norm, size_t qkv_bias, int64_t d, int64_t hd,
                      int64_t heads, int64_t kv_heads, float eps);

  // x [Mx, d] -> h = x + the branch (a new f32 tensor); saves into `a`. `mode` says what to keep:
  // `op` drops xn1 after its GEMM (neither `op` nor `full` keeps a gathered GEMM input: it goes to
  // the pooled buffer). With `round_input` (bf16's forward) the norm also rounds x in place and
  // into a.x, allocated by the caller.
  Tensor forward(const ParamUnit& unit, const StepContext& ctx, const Tensor& x, AttentionActs& a,
                 ActivationCheckpoint::Mode mode, bool round_input) const;
  // dy: the gradient w.r.t. h, turned in place into the gradient w.r.t. x (the residual's passes
  // straight through); parameter gradients accumulate. Then frees `a`.
  void backward(ParamUnit& unit, const StepContext& ctx, Tensor& dy, AttentionActs& a) const;

  // The norms, GEMMs and SwiGLU write the compute dtype themselves (no f32 copies).
  static constexpr BranchPrecision kPrecision = BranchPrecision::rounded_outputs;

  // On the f32 output of the q/k/v GEMM [M, (Hq + 2 Hkv) hd], in place (public: the inference
  // path runs them on its chunk): the q, k and v biases added to their columns; Qwen3's q/k norms
  // (their inputs saved into `a`).
  void add_biases(const ParamUnit& unit, Tensor& qkv) const;
  void qk_norm_forward(const ParamUnit& unit, Tensor& qkv, AttentionActs& a) const;

 private:
  int64_t nqkv() const { return (Hq + 2 * Hkv) * hd; }
  void attend(const StepContext& ctx, Tensor& qkv, AttentionActs& a) const;
  void attend_backward(const StepContext& ctx, AttentionActs& a, const Tensor& dattn,
                       Tensor& dqkv) const;
  // Whether the bf16 kernels leave dq and dk rotated as the forward's (the caller rotates them
  // back as it rounds dqkv for the GEMM).
  bool unrotated_dqkv(const StepContext& ctx) const;
  // The biases' gradients from dqkv's.
  void bias_grads(ParamUnit& unit, const Tensor& dqkv) const;
  void qk_norm_backward(ParamUnit& unit, Tensor& dqkv, AttentionActs& a) const;
};

}  // namespace loom
