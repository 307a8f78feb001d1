#include "model/moe_ffn.hpp"

#include <algorithm>

#include "distributed/process_group.hpp"
#include "model/moe_capacity.hpp"

namespace loom {

namespace {

size_t bytes_of(std::initializer_list<const Tensor*> ts) {
  size_t n = 0;
  for (const Tensor* t : ts)
    if (t->defined()) n += t->nbytes();
  return n;
}

}  // namespace

size_t MoeRouting::bytes() const {
  return bytes_of({&h, &rstd, &xn, &probs, &experts, &weights, &perm.order, &perm.pos, &shared_gu,
                   &shared_act, &shared_y, &shared_z, &dxn, &dweights, &dy_all});
}

size_t MoeExpertsActs::bytes() const {
  return bytes_of({&xs, &gu, &act, &ys});
}

void MoeRouter::forward(const ParamUnit& unit, MoeRouting& r, RouterStats& stats) const {
  const Device dev = r.h.device();
  r.rstd = f32({Mx}, dev);
  r.xn = Tensor::empty({Mx, d}, compute, dev);
  ops::rmsnorm_forward(r.h, unit.params()[norm].value, eps, r.xn, r.rstd);
  if (tp.on()) {
    // Every row of the tp group, kept for the backward (the router, the experts and a shared
    // expert read it).
    Tensor mine = std::move(r.xn);
    r.xn = Tensor::empty({M, d}, compute, dev);
    tp_gather_rows(tp, mine, r.xn);
  }
  // The router, in f32 from the GEMM on.
  r.probs = f32({M, E}, dev);
  ops::linear(r.xn, unit.gemm_weight(router), r.probs);
  r.experts = Tensor::empty({M, k}, DType::i32, dev);
  r.weights = f32({M, k}, dev);
  Tensor prob_sum = Tensor::zeros({E}, DType::f32, dev);
  ops::moe_route(r.probs, bias == kNone ? Tensor() : unit.params()[bias].value, renormalize,
                 r.probs, r.experts, r.weights, prob_sum);
  r.perm = permute(r.experts);
  // Nothing to count on meta: the planner prices the balance. Counted right after moe_permute,
  // which waits for its counts: on a GPU the statistics' copy then finds the stream idle.
  if (ops::computes(dev)) count(r, prob_sum, stats);
  if (shared != kNone) shared_forward(unit, r);
  if (tp.on()) r.perm = tp_expert_slice(r.perm, ep, tp.opt.size(), tp.opt.rank());
}

// Under tp every rank counts the same rows (every row of the tp group).
void MoeRouter::count(const MoeRouting& r, const Tensor& prob_sum, RouterStats& stats) const {
  const Tensor ps = prob_sum.on_host();
  if (stats.counts.empty()) {
    stats.counts.assign(size_t(E), 0);
    stats.prob_sum.assign(size_t(E), 0);
  }
  for (int64_t e = 0; e < E; ++e) stats.prob_sum[size_t(e)] += double(ps.data<float>()[e]);
  // The auxiliary loss counts every choice, the dropped ones too (transformers' expert_mask); so
  // does the load (the router's, which a capacity bounds the computed rows of). Where none was
  // dropped the kept rows' counts (on the host already) are the choices'; else the choices are
  // read back (from a GPU too).
  const size_t layer = stats.layer_counts.size();
  stats.layer_counts.resize(layer + size_t(E), 0.0);
  if (r.perm.dropped == 0) {
    for (int64_t e = 0; e < E; ++e) {
      stats.counts[size_t(e)] += double(r.perm.counts[size_t(e)]);
      stats.layer_counts[layer + size_t(e)] += double(r.perm.counts[size_t(e)]);
    }
  } else {
    const Tensor ex = r.experts.on_host();
    for (int64_t i = 0; i < M * k; ++i) {
      const size_t e = size_t(ex.data<int32_t>()[i]);
      stats.counts[e] += 1;
      stats.layer_counts[layer + e] += 1;
    }
  }
  stats.rows += M;
  stats.dropped += r.perm.dropped;
  const double most =
      *std::max_element(stats.layer_counts.begin() + long(layer), stats.layer_counts.end());
  stats.load_max_over_mean.push_back(most * double(E) / double(M * k));
}

ops::MoePermutation MoeRouter::permute(const Tensor& experts) const {
  if (capacity == 0 || !cp || cp->size() == 1) return ops::moe_permute(experts, E, capacity);
  return ops::moe_permute(experts, E, cp_capacities(*cp, *ctx, experts, E, capacity));
}

// Qwen2-MoE's shared expert on every token: sigmoid(xn . gate) x down(silu(gate_proj(xn)) x
// up_proj(xn)), its GEMMs writing the compute dtype as the experts'.
void MoeRouter::shared_forward(const ParamUnit& unit, MoeRouting& r) const {
  const Device dev = r.xn.device();
  r.shared_gu = Tensor::empty({M, 2 * shared_ffn}, compute, dev);
  ops::linear(r.xn, unit.gemm_weight(shared), r.shared_gu);
  r.shared_act = Tensor::empty({M, shared_ffn}, compute, dev);
  ops::swiglu_forward(r.shared_gu, r.shared_act);
  r.shared_y = Tensor::empty({M, d}, compute, dev);
  ops::linear(r.shared_act, unit.gemm_weight(shared + 2), r.shared_y);
  r.shared_z = f32({M, 1}, dev);
  ops::linear(r.xn, unit.gemm_weight(shared + 3), r.shared_z);
}

// dy: every row's. Under tp the gate's logit gradient is this rank's part (its part of the shared
// expert's output), and so the gate's weight gradient.
void MoeRouter::shared_backward(ParamUnit& unit, const Tensor& dy, MoeRouting& r) const {
  const Device dev = dy.device();
  Tensor dys = Tensor::empty({M, d}, compute, dev), dz = f32({M, 1}, dev);
  ops::sigmoid_gate_backward(dy, r.shared_z, r.shared_y, dys, dz);
  r.shared_y = Tensor();
  Tensor dx = f32({M, d}, dev);
  tp_summed_weight_grad(tp, unit.weight_grad(shared + 3), [&](const ops::WeightGrad& dw) {
    ops::linear_backward(in_compute(dz, compute), r.xn, unit.gemm_weight(shared + 3), dw, dx);
  });
  ops::add_inplace(r.dxn, dx);
  r.shared_z = Tensor();
  {
    Tensor dact = f32({M, shared_ffn}, dev);
    ops::linear_backward(dys, r.shared_act, unit.gemm_weight(shared + 2),
                         unit.weight_grad(shared + 2), dact);
    r.shared_act = Tensor();
    ops::swiglu_backward(dact, r.shared_gu, r.shared_gu);
  }
  ops::linear_backward(in_compute(r.shared_gu, compute), r.xn, unit.gemm_weight(shared),
                       unit.weight_grad(shared, 2), dx);
  r.shared_gu = Tensor();
  ops::add_inplace(r.dxn, dx);
}

void MoeRouter::backward(ParamUnit& unit, Tensor& dy, MoeRouting& r,
                         const RouterStats& stats) const {
  const Device dev = dy.device();
  auto& P = unit.params();
  if (shared != kNone) shared_backward(unit, tp.on() ? r.dy_all : dy, r);
  r.dy_all = Tensor();
  // Through the weights' renormalization and the softmax, the auxiliary loss's gradient added per
  // probability, then the router's GEMM; its input gradient joins the experts'. Under tp every
  // rank routed the same rows and the gradients of xn are summed over tp: one rank adds the
  // auxiliary loss's, and the router's weight gradient is each rank's part (its experts').
  const bool aux_here = !tp.on() || tp.opt.rank() == 0;
  ops::moe_route_backward(r.probs, r.experts, r.weights, r.dweights, renormalize,
                          aux_here ? stats.dprob : Tensor(), r.probs);
  r.dweights = Tensor();
  Tensor dx = f32({M, d}, dev);
  tp_summed_weight_grad(tp, unit.weight_grad(router), [&](const ops::WeightGrad& dw) {
    ops::linear_backward(in_compute(r.probs, compute), r.xn, unit.gemm_weight(router), dw, dx);
  });
  r.probs = Tensor();
  ops::add_inplace(r.dxn, dx);
  dx = Tensor();
  // Under tp: this rank's rows of the sum over tp.
  const Tensor dxn = tp.on() ? tp_sum_partial(tp, r.dxn) : r.dxn;
  tp_summed_norm_grad(tp, P[norm].grad, [&](Tensor& g) {
    ops::rmsnorm_backward(dxn, r.h, P[norm].value, r.rstd, dy, g);
  });
  r = MoeRouting();
}

int64_t MoeExperts::local() const {
  return E / (ep ? ep->size() : 1) / (tp.on() ? tp.opt.size() : 1);
}

// Each local expert's GEMM weight: parameter first + e * step of the unit.
std::vector<Tensor> MoeExperts::weights(const ParamUnit& unit, size_t first, size_t step) const {
  std::vector<Tensor> w;
  for (int64_t e = 0; e < local(); ++e) w.push_back(unit.gemm_weight(first + size_t(e) * step));
  return w;
}

// With expert parallelism the rows go to the ranks of their experts between the gather and the
// GEMMs, and come back after them (the rows' counts on this rank are then the exchange's).
Tensor MoeExperts::forward(const ParamUnit& unit, const MoeRouting& r, MoeExpertsActs& a,
                           bool output) const {
  const Device dev = r.xn.device();
  // Their rows gathered, gate/up, SwiGLU, down, each in the compute dtype (the GEMMs round their
  // outputs, as bf16 autocast's do).
  a.xs = Tensor::empty({r.perm.rows(), d}, compute, dev);
  ops::moe_dispatch(r.xn, r.perm.order, k, a.xs);
  std::span<const int64_t> counts = r.perm.counts;
  if (ep) {
    a.exchange = expert_exchange(*ep, r.perm.counts, dev);
    a.xs = expert_dispatch(*ep, a.exchange, a.xs);
    counts = a.exchange.local_counts;
  }
  const int64_t R = a.xs.size(0);
  a.gu = Tensor::empty({R, 2 * F}, compute, dev);
  ops::grouped_linear(a.xs, weights(unit, 0, 2), counts, a.gu);
  a.act = Tensor::empty({R, F}, compute, dev);
  ops::swiglu_forward(a.gu, a.act);
  a.ys = Tensor::empty({R, d}, compute, dev);
  ops::grouped_linear(a.act, weights(unit, 2 * size_t(local()), 1), counts, a.ys);
  if (ep) a.ys = expert_combine(*ep, a.exchange, a.ys);
  if (!output) return Tensor();
  Tensor y = f32({Mx, d}, dev);
  ops::copy(r.h, y);
  // Under tp this rank's part of every row's branch, then its rows of the sum over tp.
  Tensor branch = y;
  if (tp.on()) branch = Tensor::zeros({M, d}, DType::f32, dev);
  if (r.shared_z.defined()) ops::sigmoid_gate_forward(r.shared_z, r.shared_y, branch);
  ops::moe_combine(a.ys, r.weights, r.perm.pos, branch);
  if (tp.on()) ops::add_inplace(y, tp_sum_partial(tp, branch));
  return y;
}

void MoeExperts::backward(ParamUnit& unit, const Tensor& dy, MoeRouting& r,
                          MoeExpertsActs& a) const {
  const Device dev = dy.device();
  const int64_t N = r.perm.rows(), El = local();
  const size_t down = 2 * size_t(El);
  std::span<const int64_t> counts = ep ? std::span<const int64_t>(a.exchange.local_counts)
                                       : std::span<const int64_t>(r.perm.counts);
  r.dweights = f32({M, k}, dev);
  if (tp.on()) {
    r.dy_all = f32({M, d}, dev);
    tp_gather_rows(tp, dy, r.dy_all);
  }
  {
    Tensor dys = Tensor::empty({N, d}, compute, dev);
    ops::moe_combine_backward(tp.on() ? r.dy_all : dy, a.ys, r.weights, r.perm.pos, dys,
                              r.dweights);
    a.ys = Tensor();
    if (ep) dys = expert_dispatch(*ep, a.exchange, dys);
    Tensor dact = f32({dys.size(0), F}, dev);
    std::vector<ops::WeightGrad> dw;
    for (int64_t e = 0; e < El; ++e) dw.push_back(unit.weight_grad(down + size_t(e)));
    ops::grouped_linear_backward(dys, a.act, weights(unit, down, 1), counts, dw, dact);
    a.act = Tensor();
    // In place over gu, in its dtype: in bf16 the kernel rounds the gradient for the GEMM.
    ops::swiglu_backward(dact, a.gu, a.gu);
  }
  r.dxn = f32({M, d}, dev);
  Tensor dxs = f32({a.xs.size(0), d}, dev);
  {
    std::vector<ops::WeightGrad> dw;
    for (int64_t e = 0; e < El; ++e) dw.push_back(unit.weight_grad(2 * size_t(e), 2));
    ops::grouped_linear_backward(in_compute(a.gu, compute), a.xs, weights(unit, 0, 2), counts, dw,
                                 dxs);
  }
  // The exchange's gradients in f32, as the GEMM wrote them.
  if (ep) dxs = expert_combine(*ep, a.exchange, dxs);
  a = MoeExpertsActs();
  ops::moe_dispatch_backward(dxs, r.perm.pos, k, r.dxn, false);
}

}  // namespace loom
