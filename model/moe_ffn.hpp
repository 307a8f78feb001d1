#pragma once
// The mixture-of-experts feed-forward branch of a pre-norm block (Qwen3-MoE's sparse MLP,
// Mixtral's block_sparse_moe): out = h + sum over each token's k chosen experts of
// weight x expert(xn), xn = rmsnorm(h), an expert a SwiGLU MLP. The router is a linear layer,
// softmax, top-k (ties to the lower expert), optionally renormalized; tokens are grouped by expert
// (a stable counting sort), each expert's rows run through its GEMMs (ops::grouped_linear), and
// the outputs are combined back by weight. Dropless unless a capacity is given. Forward beside
// backward; the router's statistics feed the auxiliary load-balancing loss
// (docs/decisions/moe.md).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.hpp"
#include "model/norm_input.hpp"
#include "model/param_unit.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/activation_checkpoint.hpp"

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
  // Per sparse layer: the most tokens any expert got, over the mean (1: balanced).
  std::vector<double> load_max_over_mean;
  // d(loss) / d(probability of expert e), the same for every token and layer (undefined: no
  // auxiliary loss).
  Tensor dprob;
};

// What the branch's backward reads.
struct MoeFfnActs {
  Tensor h;        // the branch's input, the residual stream after attention [M, d]
  Tensor rstd;     // the norm's [M]
  Tensor xn;       // the norm output, as the GEMMs read it [M, d]
  Tensor probs;    // the router's softmax [M, E] f32
  Tensor experts;  // [M, k] i32
  Tensor weights;  // [M, k] f32
  ops::MoePermutation perm;
  Tensor xs;   // xn's rows by expert [N, d]
  Tensor gu;   // the experts' gate and up projections [N, 2F]
  Tensor act;  // silu(gate) * up [N, F]
  Tensor ys;   // the experts' outputs [N, d]
  size_t bytes() const;
};

struct MoeFfn {
  // Its parameters' indices in the block's unit: the norm, the router, the first expert's
  // gate (gate_e, up_e of expert e at gate + 2e: one fused matrix each) and the first expert's
  // down (down_e at down + e).
  size_t norm, router, gate, down;
  int64_t M, d, E, k, F;  // rows, hidden size, experts, choices per token, each expert's ffn size
  bool renormalize;
  int64_t capacity;  // rows per expert at most; 0: dropless
  float eps;
  DType compute;

  // a.h [M, d] -> h + the branch [M, d] (a new tensor); saves into `a`, adds the router's
  // statistics to `stats`. Without `output` the combine is skipped (a `full` block's
  // recomputation) and an empty tensor returned.
  Tensor forward(const ParamUnit& unit, MoeFfnActs& a, RouterStats& stats,
                 bool output = true) const;
  // dy: the gradient w.r.t. the branch's output, to which the gradient through the branch is
  // added in place; parameter gradients accumulate (stats.dprob: the auxiliary loss's). Then
  // frees `a`.
  void backward(ParamUnit& unit, Tensor& dy, MoeFfnActs& a, const RouterStats& stats) const;

  static constexpr BranchPrecision kPrecision = BranchPrecision::rounded_outputs;

 private:
  std::vector<Tensor> weights(const ParamUnit& unit, size_t first, size_t step) const;
};

}  // namespace loom
