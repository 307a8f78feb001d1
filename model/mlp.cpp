#include "model/mlp.hpp"

#include "ops/ops.hpp"

namespace loom {

size_t MlpActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&h, &rstd, &xn, &gu, &act})
    if (t->defined()) n += t->nbytes();
  return n;
}

Tensor Mlp::swiglu(const Tensor& gu) const {
  Tensor act = Tensor::empty({M, F}, output_dtype(precision, compute), gu.device());
  ops::swiglu_forward(gu, act);
  return in_compute(act, compute);
}

Tensor Mlp::forward(const ParamUnit& unit, MlpActs& a, ActivationCheckpoint::Mode mode,
                    bool output) const {
  const Device dev = a.h.device();
  const DType out = output_dtype(precision, compute);
  const bool op = mode == ActivationCheckpoint::Mode::op;
  a.rstd = Tensor::empty({Mx}, DType::f32, dev);
  {
    Tensor xn = Tensor::empty({Mx, d}, out, dev);
    ops::rmsnorm_forward(a.h, unit.params()[norm].value, eps, xn, a.rstd);
    // With rounded outputs the GEMM writes gate/up in the compute dtype (in bf16 rounded from f32
    // in its kernel, no f32 copy): SwiGLU reads the rounded gate/up, and its backward the same
    // values.
    a.gu = Tensor::empty({M, 2 * F}, out, dev);
    column_parallel_forward(tp, in_compute(xn, compute), unit.gemm_weight(gate),
                            keep_gathered && mode == ActivationCheckpoint::Mode::none, a.xn, a.gu);
    if (op) a.xn = Tensor();
  }
  a.act = swiglu(a.gu);
  if (!output) return Tensor();
  Tensor y = row_parallel_forward(tp, a.act, unit.gemm_weight(down), a.h);
  if (op) a.act = Tensor();
  return y;
}

void Mlp::backward(ParamUnit& unit, Tensor& dy, MlpActs& a) const {
  const Device dev = dy.device();
  auto& P = unit.params();
  // `op` dropped the SwiGLU output: silu(gate) * up again, before its backward overwrites gu. In
  // f32 its f32 output is rounded and freed before dact is made.
  if (!a.act.defined() && precision == BranchPrecision::f32_outputs) a.act = swiglu(a.gu);
  Tensor dgu = a.gu;
  a.gu = Tensor();
  // The rounded branch frees each gradient as soon as it is read; with f32 outputs dact and the
  // f32 dgu stay to the branch's end (and the saved norm output to after its gradient), the
  // lifetimes GLA's memory model was measured with.
  const bool free_early = precision == BranchPrecision::rounded_outputs;
  Tensor dact = Tensor::empty({M, F}, DType::f32, dev);
  if (!a.act.defined()) a.act = swiglu(dgu);
  row_parallel_backward(tp, dy, a.act, unit.gemm_weight(down), unit.weight_grad(down), dact,
                        compute);
  a.act = Tensor();
  // In place over gu, in its dtype: with rounded outputs the kernel rounds the gradient for the
  // GEMM.
  ops::swiglu_backward(dact, dgu, dgu);
  if (free_early) dact = Tensor();
  Tensor dxn = column_parallel_backward(
      tp, in_compute(dgu, compute),
      norm_gemm_input(tp, precision, compute, a.xn, keep_gathered, a.h, P[norm].value, eps),
      unit.gemm_weight(gate), unit.weight_grad(gate, 2));
  if (free_early) {
    dgu = Tensor();
    a.xn = Tensor();
  }
  tp_summed_norm_grad(tp, P[norm].grad, [&](Tensor& gw) {
    ops::rmsnorm_backward(dxn, a.h, P[norm].value, a.rstd, dy, gw);
  });
  a.h = a.rstd = a.xn = Tensor();
}

}  // namespace loom
