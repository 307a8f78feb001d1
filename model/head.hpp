#pragma once
// The output head every family shares (Llama's, GLA's): the final RMSNorm, then the output
// projection fused with the cross-entropy loss, its forward fused with its backward (the head's
// forward only keeps its input; Model::backward of the head unit runs this). Whether the
// projection is vocabulary-parallel over tp or replicated is the model's TP plan's (the entry of
// the output weight: lm_head, or the embedding when tied); where the normed rows are rounded to
// the compute dtype, and with it the order of the head's buffers, is its model's BranchPrecision.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/norm_input.hpp"
#include "model/param_unit.hpp"
#include "model/tp_plan.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

// The embedding's and the head's parameters under Llama's names (model.embed_tokens, then
// model.norm and, untied, lm_head), split as `plan` says over `tp` ranks (this one `tp_rank`). A
// vocabulary that tp does not divide is padded to the next multiple of tp (Megatron's
// make-vocab-size-divisible-by): the padding rows are zero, their logits are masked out of the
// loss, and checkpoints hold the real rows only (ParamSpec::global_rows).
struct VocabSpecs {
  ParamSpec embedding;
  std::vector<ParamSpec> head;
};
VocabSpecs llama_vocab_specs(std::span<const PlanEntry> plan, int64_t vocab, int64_t d, bool tied,
                             int tp_rank, int tp);
// The first vocabulary row of this tp rank's part of a vocabulary-parallel embedding (or head).
inline int64_t vocab_begin(int64_t vocab, int tp_rank, int tp) {
  return int64_t(tp_rank) * local_vocab(vocab, tp);
}

// Whether the plan splits the output projection's weight `name` by vocabulary rows over tp (the
// loss parallel: column-parallel) rather than keeping it whole on every rank (replicated); a
// row-parallel entry is an error naming it.
bool vocab_parallel_output(std::span<const PlanEntry> plan, const std::string& name);

// The head as a model runs it on one micro-batch: the head unit holds the final norm's weight
// (its parameter 0) and, untied, the output projection (parameter 1); tied, the projection is the
// embedding unit's table (parameter 0).
struct LossHead {
  const TpRuntime& tp;
  std::span<const PlanEntry> plan;  // the model's TP plan: the output weight's entry
  // rounded_outputs (Llama): the norm writes the compute dtype, which is freed once the loss
  // holds it (under SP once gathered), and the gradient of the normed rows is made after it.
  // f32_outputs (GLA): the norm writes f32, kept to the end with its rounded copy for the GEMMs,
  // and that gradient is made with the norm's own tensors. The lifetimes each family's memory
  // model was measured with (model/llama_cost.cpp, model/gla_cost.cpp).
  BranchPrecision precision;
  bool tied;             // the output projection is the embedding's table
  int64_t M, Mx, d;      // rows (Mx: of the input, M / tp under SP), hidden size
  int64_t vocab;         // the real vocabulary (vocabulary-parallel: local_vocab's rows per rank)
  float eps;             // the final norm's
  DType compute;         // what the GEMMs read
  int64_t chunk_rows{};  // rows per chunk of f32 logits (0: the kernel's default)
  int64_t grad_rows{};   // ops::LinearCrossEntropy::grad_rows (0: one chunk's)

  // x [Mx, d]: the head's input, the last block's output. Writes `loss` (float64 [1] on the
  // device: the summed loss of the M rows, the same on every tp rank), accumulates the norm's and
  // the projection's gradients (the norm's summed over tp under SP; a vocabulary-parallel
  // projection's of this rank's rows) and returns the gradient w.r.t. x [Mx, d] (f32).
  Tensor forward_backward(ParamUnit& head, ParamUnit& embed, const Tensor& x, const Tensor& targets,
                          float grad_scale, const Tensor& loss) const;
};

}  // namespace loom
