#pragma once
// The mixture-of-experts feed-forward branch of a pre-norm block (Qwen3-MoE's sparse MLP,
// Mixtral's block_sparse_moe): out = h + sum over each token's k chosen experts of
// weight x expert(xn), xn = rmsnorm(h), an expert a SwiGLU MLP. In two halves, each in its own
// parameter unit (expert parallelism shards the experts over another group than the rest):
// MoeRouter (the norm, the router GEMM, softmax, top-k with ties to the lower expert, the tokens
// grouped by expert by a stable counting sort) and MoeExperts (each expert's rows through its
// GEMMs, ops::grouped_linear, combined back by weight). Dropless unless a capacity is given. What
// the router decided travels to the experts in MoeRouting, and the gradients back the same way.
// The router's statistics feed the auxiliary load-balancing loss (docs/decisions/moe.md).
// Under tensor parallelism (with SP) the norm runs on this rank's rows, its output is gathered,
// every tp rank routes every row of its tp group and computes its slice of the experts (and of a
// shared expert, split as Llama's MLP); the branch's partial outputs are reduce-scattered back to
// each rank's rows (Megatron's all-gather token dispatcher; docs/decisions/moe.md).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/norm_input.hpp"
#include "model/param_unit.hpp"
#include "model/step_context.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/expert_parallel.hpp"

namespace loom {

// One micro-batch's router statistics, summed over its sparse layers as they run forward (the
// auxiliary loss of transformers' load_balancing_loss_func concatenates the sparse layers' tokens),
// and the loss's gradient per expert probability, which the head sets from them before any
// backward.
struct RouterStats {
  std::vector<double> counts;    // [E]: top-k choices per expert
  std::vector<double> prob_sum;  // [E]: the router probabilities summed over tokens
  int64_t rows = 0;              // tokens routed, over the sparse layers
  int64_t dropped = 0;           // choices over an expert's capacity
  // Per sparse layer: the most tokens any expert was chosen by (before a capacity drops any),
  // over the mean (1: balanced).
  std::vector<double> load_max_over_mean;
  // Per sparse layer in the order they ran, its E choice counts (the bias's load, model/
  // moe_balance.hpp).
  std::vector<double> layer_counts;
  // d(loss) / d(probability of expert e), the same for every token and layer (undefined: no
  // auxiliary loss).
  Tensor dprob;
};

// One sparse layer's routing of a micro-batch: what the router saves for its backward and hands
// to the experts, and what the experts' backward hands back.
struct MoeRouting {
  Tensor h;        // the branch's input, the residual stream after attention [Mx, d] (f32)
  Tensor rstd;     // the norm's [Mx]
  Tensor xn;       // the norm output, as the GEMMs read it, every row of the tp group [M, d]
  Tensor probs;    // the router's softmax [M, E] f32
  Tensor experts;  // [M, k] i32
  Tensor weights;  // [M, k] f32
  ops::MoePermutation perm;
  // Qwen2-MoE's shared expert: its gate/up [M, 2Fs], SwiGLU [M, Fs] and output [M, d] in the
  // compute dtype, and its gate's logit [M, 1] f32 (the experts' forward adds sigmoid(z) x its
  // output).
  Tensor shared_gu, shared_act, shared_y, shared_z;
  // Set by the experts' backward for the router's: d(xn) through the experts [M, d] f32, and
  // d(weights) [M, k] f32 (under tp: this rank's parts, summed over tp later), and under tp the
  // gradient w.r.t. the block's output, every row [M, d] f32.
  Tensor dxn, dweights, dy_all;
  size_t bytes() const;
};

// The router half: its parameters' indices in the unit that holds them (with Qwen2-MoE's shared
// expert: its gate and up (one fused matrix), its down, and its gate, adjacent from `shared`).
struct MoeRouter {
  static constexpr size_t kNone = size_t(-1);
  const TpRuntime& tp;
  size_t norm, router;
  size_t shared = kNone;
  int64_t shared_ffn = 0;  // this tp rank's part of the shared expert's
  // Rows routed (every row of the tp group), rows of h (M / tp under SP), hidden size, experts,
  // choices per token, expert-parallel ranks.
  int64_t M, Mx, d, E, k;
  int ep;
  bool renormalize;
  // Rows per expert at most in the micro-batch (over the cp ranks: cp_capacities); 0: dropless.
  int64_t capacity;
  float eps;
  DType compute;
  size_t bias = kNone;               // the selection-only bias (MoeConfig::expert_bias)
  dist::ProcessGroup* cp = nullptr;  // context parallelism: the micro-batch's other ranks
  const StepContext* ctx = nullptr;  // their positions (a capacity under cp reads them)

  // r.h [Mx, d] set by the caller: the norm, the router and the grouping into `r`; the router's
  // statistics added to `stats`.
  void forward(const ParamUnit& unit, MoeRouting& r, RouterStats& stats) const;
  // After the experts' backward (r.dxn, r.dweights): the shared expert, the router (stats.dprob:
  // the auxiliary loss's gradient) and the norm; dy, the gradient w.r.t. the block's output, gets
  // the gradient through the branch added (the residual's passes straight through). Frees `r`.
  void backward(ParamUnit& unit, Tensor& dy, MoeRouting& r, const RouterStats& stats) const;

 private:
  // The tokens grouped by expert, at most `capacity` rows each over the micro-batch.
  ops::MoePermutation permute(const Tensor& experts) const;
  void count(const MoeRouting& r, const Tensor& prob_sum, RouterStats& stats) const;
  void shared_forward(const ParamUnit& unit, MoeRouting& r) const;
  void shared_backward(ParamUnit& unit, const Tensor& dy, MoeRouting& r) const;
};

// What the experts' backward reads.
struct MoeExpertsActs {
  ExpertExchange exchange;  // with expert parallelism: this layer's
  Tensor xs;                // xn's rows by (this rank's) expert [N, d]
  Tensor gu;                // the experts' gate and up projections [N, 2F]
  Tensor act;               // silu(gate) * up [N, F]
  Tensor ys;                // the experts' outputs [N, d]
  size_t bytes() const;
};

// The experts half: this rank's experts (all of them, or with expert parallelism E / ep of them:
// parallel/layers/expert_parallel.hpp), local expert e's gate and up (one fused matrix) parameter
// 2e of its unit, its down parameter 2 El + e.
struct MoeExperts {
  dist::ProcessGroup* ep;     // nullptr: no expert parallelism
  const TpRuntime& tp;        // on: this rank computes its slice of the experts (tp_expert_slice)
  int64_t M, Mx, d, E, k, F;  // as MoeRouter's; F: an expert's ffn
  DType compute;

  // r.h + the branch [Mx, d] (a new tensor), from the routing; saves into `a`. Without `output` the
  // combine is skipped (a recomputation for backward) and an empty tensor returned.
  Tensor forward(const ParamUnit& unit, const MoeRouting& r, MoeExpertsActs& a,
                 bool output = true) const;
  // dy: the gradient w.r.t. the block's output (left as it is: the residual's passes through to
  // r.h); sets r.dxn and r.dweights, parameter gradients accumulate. Frees `a`.
  void backward(ParamUnit& unit, const Tensor& dy, MoeRouting& r, MoeExpertsActs& a) const;

 private:
  int64_t local() const;  // this rank's experts
  std::vector<Tensor> weights(const ParamUnit& unit, size_t first, size_t step) const;
};

}  // namespace loom
