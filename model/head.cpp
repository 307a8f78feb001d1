#include "model/head.hpp"

#include "core/error.hpp"
#include "ops/ops.hpp"

namespace loom {

VocabSpecs llama_vocab_specs(std::span<const PlanEntry> plan, int64_t vocab, int64_t d, bool tied,
                             int tp_rank, int tp) {
  const int64_t V = local_vocab(vocab, tp);
  const int64_t real_rows = V * tp == vocab ? 0 : vocab;
  auto rows_of = [&](const char* name, bool f32_value) {
    return ParamSpec{name,    {V, d}, Init::normal, 0.02f, true, f32_value, split_of(plan, name),
                     tp_rank, tp,     real_rows};
  };
  VocabSpecs out{rows_of("model.embed_tokens.weight", true),
                 {{"model.norm.weight", {d}, Init::ones, 0, false, true}}};
  if (!tied) {
    out.head.push_back(rows_of("lm_head.weight", false));
    // Only the loss's dW GEMMs write the output head's gradient (ParamUnit::zero_grad).
    out.head.back().gemm_grad = true;
  }
  return out;
}

bool vocab_parallel_output(std::span<const PlanEntry> plan, const std::string& name) {
  const TpStyle style = style_of(plan, name);
  LOOM_CHECK(style != TpStyle::row, "output head: the plan makes ", name,
             " row-parallel; the fused loss takes it split by vocabulary rows (column-parallel) "
             "or whole (replicated)");
  return style == TpStyle::column;
}

Tensor LossHead::forward_backward(ParamUnit& head, ParamUnit& embed, const Tensor& x,
                                  const Tensor& targets, float grad_scale,
                                  const Tensor& loss) const {
  const Device dev = x.device();
  Param& norm = head.params()[0];
  ParamUnit& out_unit = tied ? embed : head;
  const size_t out = tied ? 0 : 1;
  const bool vocab_parallel = vocab_parallel_output(plan, out_unit.params()[out].spec.name);
  // Vocabulary-parallel: this rank's rows [v0, v0 + V) of the padded vocabulary, and a partial dx
  // of every row (summed over tp below, in a pooled buffer); replicated: every row's whole dx.
  const int64_t V = vocab_parallel ? local_vocab(vocab, tp.opt.size()) : vocab;
  auto grad_buffer = [&] {
    return vocab_parallel && tp.on()
               ? tp_pooled(tp, dist::BufferPurpose::col_dx, {M, d}, DType::f32, dev)
               : Tensor::empty({M, d}, DType::f32, dev);
  };
  // Each precision's order of the buffers (LossHead::precision): rounded, the loss holds the only
  // reference to the normed rows and dxf comes after the gather; f32, everything stays to the end.
  const bool free_early = precision == BranchPrecision::rounded_outputs;
  Tensor rstd = Tensor::empty({Mx}, DType::f32, dev),
         xf = Tensor::empty({Mx, d}, output_dtype(precision, compute), dev), dxf;
  if (!free_early) dxf = grad_buffer();
  ops::rmsnorm_forward(x, norm.value, eps, xf, rstd);
  ops::LinearCrossEntropy ce;
  ce.x = in_compute(xf, compute);
  if (free_early) xf = Tensor();
  if (tp.sp()) ce.x = tp_gather_input(tp, ce.x);
  if (free_early) dxf = grad_buffer();
  ce.w = out_unit.gemm_weight(out);
  ce.dx = dxf;
  ce.dw = out_unit.weight_grad(out);
  ce.targets = targets;
  ce.V = V;
  ce.grad_scale = grad_scale;
  ce.chunk_rows = chunk_rows;
  ce.grad_rows = grad_rows;
  ce.loss = loss;
  if (vocab_parallel)
    vocab_parallel_cross_entropy(tp, ce, int64_t(tp.opt.rank()) * V, vocab);
  else
    ops::linear_cross_entropy(ce);
  if (free_early) ce.x = Tensor();
  if (vocab_parallel && tp.on()) dxf = tp_sum_partial(tp, dxf);
  Tensor dx = Tensor::zeros({Mx, d}, DType::f32, dev);
  // Replicated under SP: this rank's rows of the whole gradient.
  const Tensor dxf_mine =
      !vocab_parallel && tp.sp() ? dxf.narrow(0, int64_t(tp.opt.rank()) * Mx, Mx) : dxf;
  tp_summed_norm_grad(tp, norm.grad, [&](Tensor& g) {
    ops::rmsnorm_backward(dxf_mine, x, norm.value, rstd, dx, g);
  });
  return dx;
}

}  // namespace loom
