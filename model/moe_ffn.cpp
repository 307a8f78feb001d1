#include "model/moe_ffn.hpp"

#include <algorithm>

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

}  // namespace

size_t MoeFfnActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t :
       {&h, &rstd, &xn, &probs, &experts, &weights, &perm.order, &perm.pos, &xs, &gu, &act, &ys})
    if (t->defined()) n += t->nbytes();
  return n;
}

// Each expert's GEMM weight: parameter first + e * step of the unit.
std::vector<Tensor> MoeFfn::weights(const ParamUnit& unit, size_t first, size_t step) const {
  std::vector<Tensor> w;
  for (int64_t e = 0; e < E; ++e) w.push_back(unit.gemm_weight(first + size_t(e) * step));
  return w;
}

Tensor MoeFfn::forward(const ParamUnit& unit, MoeFfnActs& a, RouterStats& stats,
                       bool output) const {
  const Device dev = a.h.device();
  const auto& P = unit.params();
  a.rstd = f32({M}, dev);
  a.xn = Tensor::empty({M, d}, compute, dev);
  ops::rmsnorm_forward(a.h, P[norm].value, eps, a.xn, a.rstd);

  // The router, in f32 from the GEMM on.
  a.probs = f32({M, E}, dev);
  ops::linear(a.xn, unit.gemm_weight(router), a.probs);
  a.experts = Tensor::empty({M, k}, DType::i32, dev);
  a.weights = f32({M, k}, dev);
  Tensor prob_sum = Tensor::zeros({E}, DType::f32, dev);
  ops::moe_route(a.probs, Tensor(), renormalize, a.probs, a.experts, a.weights, prob_sum);
  a.perm = ops::moe_permute(a.experts, E, capacity);
  if (ops::computes(dev)) {
    // On meta there is nothing to count: the planner prices the balanced case.
    const Tensor ps = prob_sum.on_host();
    if (stats.counts.empty())
      stats.counts.assign(size_t(E), 0), stats.prob_sum.assign(size_t(E), 0);
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e) {
      stats.prob_sum[size_t(e)] += double(ps.data<float>()[e]);
      most = std::max(most, a.perm.counts[size_t(e)]);
    }
    // The auxiliary loss counts every choice, the dropped ones too (transformers' expert_mask).
    const Tensor ex = a.experts.on_host();
    for (int64_t i = 0; i < M * k; ++i) stats.counts[size_t(ex.data<int32_t>()[i])] += 1;
    stats.rows += M;
    stats.dropped += a.perm.dropped;
    stats.load_max_over_mean.push_back(double(most) * double(E) / double(M * k));
  }

  // The experts: their rows gathered, gate/up, SwiGLU, down, each in the compute dtype (the GEMMs
  // round their outputs, as bf16 autocast's do).
  const int64_t N = a.perm.rows();
  a.xs = Tensor::empty({N, d}, compute, dev);
  ops::moe_dispatch(a.xn, a.perm.order, k, a.xs);
  a.gu = Tensor::empty({N, 2 * F}, compute, dev);
  ops::grouped_linear(a.xs, weights(unit, gate, 2), a.perm.counts, a.gu);
  a.act = Tensor::empty({N, F}, compute, dev);
  ops::swiglu_forward(a.gu, a.act);
  a.ys = Tensor::empty({N, d}, compute, dev);
  ops::grouped_linear(a.act, weights(unit, down, 1), a.perm.counts, a.ys);
  if (!output) return Tensor();
  Tensor y = f32({M, d}, dev);
  ops::copy(a.h, y);
  ops::moe_combine(a.ys, a.weights, a.perm.pos, y);
  return y;
}

void MoeFfn::backward(ParamUnit& unit, Tensor& dy, MoeFfnActs& a, const RouterStats& stats) const {
  const Device dev = dy.device();
  auto& P = unit.params();
  const int64_t N = a.perm.rows();
  Tensor dweights = f32({M, k}, dev);
  {
    Tensor dys = Tensor::empty({N, d}, compute, dev);
    ops::moe_combine_backward(dy, a.ys, a.weights, a.perm.pos, dys, dweights);
    a.ys = Tensor();
    Tensor dact = f32({N, F}, dev);
    std::vector<ops::WeightGrad> dw;
    for (int64_t e = 0; e < E; ++e) dw.push_back(unit.weight_grad(down + size_t(e)));
    ops::grouped_linear_backward(dys, a.act, weights(unit, down, 1), a.perm.counts, dw, dact);
    a.act = Tensor();
    // In place over gu, in its dtype: in bf16 the kernel rounds the gradient for the GEMM.
    ops::swiglu_backward(dact, a.gu, a.gu);
  }
  Tensor dxn = f32({M, d}, dev);
  {
    Tensor dxs = f32({N, d}, dev);
    std::vector<ops::WeightGrad> dw;
    for (int64_t e = 0; e < E; ++e) dw.push_back(unit.weight_grad(gate + 2 * size_t(e), 2));
    ops::grouped_linear_backward(in_compute(a.gu, compute), a.xs, weights(unit, gate, 2),
                                 a.perm.counts, dw, dxs);
    a.gu = a.xs = Tensor();
    ops::moe_dispatch_backward(dxs, a.perm.pos, k, dxn, false);
  }
  {
    // The router: through the weights' renormalization and the softmax, the auxiliary loss's
    // gradient added per probability, then its GEMM (its input gradient added to the experts').
    ops::moe_route_backward(a.probs, a.experts, a.weights, dweights, renormalize, stats.dprob,
                            a.probs);
    Tensor dx = f32({M, d}, dev);
    ops::linear_backward(in_compute(a.probs, compute), a.xn, unit.gemm_weight(router),
                         unit.weight_grad(router), dx);
    a.probs = Tensor();
    ops::add_inplace(dxn, dx);
  }
  ops::rmsnorm_backward(dxn, a.h, P[norm].value, a.rstd, dy, P[norm].grad);
  a = MoeFfnActs();
}

}  // namespace loom
