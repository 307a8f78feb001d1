#include "model/gla_block.hpp"

#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "model/gla_plan.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

namespace {

// fla's current init: every linear N(0, initializer_range), o and down included; the gate bias 0
// (a decay of logsigmoid(0)/16 per token at the start); norm weights 1. Under tensor parallelism
// (the spec's plan): q, k, v, g, gk_proj.1 (weight and bias), the convolutions, gate and up split
// by rows (whole heads per rank), o and down by columns; the norms and gk_proj.0 replicated.
std::vector<ParamSpec> gla_block_specs(const GlaConfig& c, int64_t layer, int tp_rank, int tp,
                                       GlaBlock::Index& ix) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t d = c.hidden_size, G = c.kv_groups(), Kd = c.key_dim() / tp,
                Vd = c.value_dim() / tp;
  const int64_t r = c.gate_low_rank_dim, F = c.intermediate_size / tp;
  const float s = float(c.initializer_range);
  std::vector<ParamSpec> specs;
  int unused = 0;
  auto add = [&](int& index, ParamSpec sp) {
    sp.split = split_of(gla_plan(), sp.name);
    sp.tp_rank = tp_rank;
    sp.tp_count = tp;
    index = int(specs.size());
    specs.push_back(std::move(sp));
  };
  add(ix.norm1, {p + "attn_norm.weight", {d}, Init::ones, 0, false, true});
  add(ix.q, {p + "attn.q_proj.weight", {Kd, d}, Init::normal, s, true, false});
  add(unused, {p + "attn.k_proj.weight", {Kd / G, d}, Init::normal, s, true, false});
  add(unused, {p + "attn.v_proj.weight", {Vd / G, d}, Init::normal, s, true, false});
  if (c.use_output_gate)
    add(unused, {p + "attn.g_proj.weight", {Vd, d}, Init::normal, s, true, false});
  add(ix.gk0, {p + "attn.gk_proj.0.weight", {r, d}, Init::normal, s, true, false});
  add(ix.gk1, {p + "attn.gk_proj.1.weight", {Kd / G, r}, Init::normal, s, true, false});
  add(ix.gb1, {p + "attn.gk_proj.1.bias", {Kd / G}, Init::normal, 0.0f, false, true});
  if (c.elementwise_affine)
    add(ix.gnorm, {p + "attn." + c.output_norm_name() + ".weight",
                   {c.head_v_dim()},
                   Init::ones,
                   0,
                   false,
                   true});
  add(ix.o, {p + "attn.o_proj.weight", {d, Vd}, Init::normal, s, true, false});
  if (c.use_short_conv) {
    const int64_t W = c.conv_size;
    add(ix.conv, {p + "attn.q_conv1d.weight", {Kd, 1, W}, Init::normal, s, true, true});
    add(unused, {p + "attn.k_conv1d.weight", {Kd / G, 1, W}, Init::normal, s, true, true});
    add(unused, {p + "attn.v_conv1d.weight", {Vd / G, 1, W}, Init::normal, s, true, true});
  }
  add(ix.norm2, {p + "mlp_norm.weight", {d}, Init::ones, 0, false, true});
  add(ix.gate, {p + "mlp.gate_proj.weight", {F, d}, Init::normal, s, true, false});
  add(unused, {p + "mlp.up_proj.weight", {F, d}, Init::normal, s, true, false});
  add(ix.down, {p + "mlp.down_proj.weight", {d, F}, Init::normal, s, true, false});
  // What only dW GEMMs write (ParamUnit::zero_grad): the fused projection q, k, v, (g,) gk_proj.0,
  // gk_proj.1, o, gate/up, down.
  for (int i = ix.q; i <= ix.gk1; ++i) specs[size_t(i)].gemm_grad = true;
  for (int i : {ix.o, ix.gate, ix.gate + 1, ix.down}) specs[size_t(i)].gemm_grad = true;
  return specs;
}

const ParallelContext& checked(const ParallelContext* par, const GlaConfig& c) {
  const ParallelContext& p = par ? *par : no_parallelism();
  if (p.tp.on()) {
    const int n = p.tp.opt.size();
    for (auto [what, v] : {std::pair<const char*, int64_t>{"num_heads", c.num_heads},
                           {"num_kv_heads", c.num_kv_heads},
                           {"intermediate_size", c.intermediate_size}})
      LOOM_CHECK(v % n == 0, "GLA tensor parallelism: model ", what, " = ", v,
                 " is not divisible by parallelism.tp = ", n, " (every tp rank holds whole ", what,
                 " / tp)");
  }
  return p;
}

}  // namespace

struct GlaBlock::Dims {
  int64_t M, Mx, d, H, Hkv, Kd, Kg, Vd, Vg, rank, F, nproj;  // Mx: rows of the residual here
  float eps, normalizer, clamp;
};

GlaBlock::GlaBlock(const GlaConfig& c, int64_t layer, bool bf16, Device device,
                   const ParallelContext* par, ShardLayout shard)
    : c_(c),
      par_(&checked(par, c)),
      unit_("layers." + std::to_string(layer),
            gla_block_specs(c, layer, par_->tp.opt.rank(), par_->tp.opt.size(), ix_), bf16, device,
            shard) {}

// This tp rank's sizes (its heads) of one micro-batch.
GlaBlock::Dims GlaBlock::dims(const StepContext& ctx) const {
  const int tp = par_->tp.opt.size();
  Dims g;
  g.M = ctx.tokens();
  g.Mx = par_->tp.sp() ? g.M / tp : g.M;
  g.d = c_.hidden_size;
  g.H = c_.num_heads / tp;
  g.Hkv = c_.num_kv_heads / tp;
  g.Kd = c_.key_dim() / tp;
  g.Kg = g.Kd / c_.kv_groups();
  g.Vd = c_.value_dim() / tp;
  g.Vg = g.Vd / c_.kv_groups();
  g.rank = c_.gate_low_rank_dim;
  g.F = c_.intermediate_size / tp;
  g.nproj = g.Kd + g.Kg + g.Vg + (c_.use_output_gate ? g.Vd : 0) + g.rank;
  g.eps = float(c_.norm_eps);
  g.normalizer = float(c_.gate_logit_normalizer);
  g.clamp = c_.has_clamp_min ? float(c_.clamp_min) : -std::numeric_limits<float>::infinity();
  return g;
}

size_t GlaBlockActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&x, &rstd1, &xn1, &proj, &qkv_c, &r, &z, &gk, &o, &rstd_o, &y})
    if (t->defined()) n += t->nbytes();
  return n + mlp.bytes();
}

Mlp GlaBlock::mlp(const StepContext& ctx) const {
  const Dims g = dims(ctx);
  return {par_->tp,
          size_t(ix_.norm2),
          size_t(ix_.gate),
          size_t(ix_.down),
          kPrecision,
          g.M,
          g.Mx,
          g.d,
          g.F,
          g.eps,
          ctx.compute,
          true};
}

Tensor GlaBlock::forward(const StepContext& ctx, const Tensor& x, GlaBlockActs& a) const {
  // In bf16 the input is rounded to bf16 in place and saved so, as in LlamaBlock::forward.
  const Tensor input = ops::to_compute(x, ctx.compute);
  if (ctx.compute != DType::f32) {
    Tensor rounded = x;
    ops::cast(input, rounded);
  }
  Tensor out = run_forward(ctx, x, a);
  a.x = input;
  if (ac_ == ActivationCheckpoint::Mode::full) {
    // Only the input stays; backward recomputes the rest from it.
    a = GlaBlockActs();
    a.x = input;
  } else if (ac_ == ActivationCheckpoint::Mode::op) {
    // Element-wise outputs that backward recomputes from what stays (the same kernels on the same
    // inputs: the same bits).
    a.xn1 = a.y = a.mlp.xn = a.mlp.act = Tensor();
  }
  return out;
}

Tensor GlaBlock::run_forward(const StepContext& ctx, const Tensor& x, GlaBlockActs& a) const {
  const TpRuntime& tp = par_->tp;
  const Dims g = dims(ctx);
  const auto& P = unit_.params();
  const Device dev = x.device();
  const DType dt = ctx.compute;
  Tensor none;

  a.rstd1 = f32({g.Mx}, dev);
  {
    Tensor xn1 = f32({g.Mx, g.d}, dev);
    ops::rmsnorm_forward(x, P[size_t(ix_.norm1)].value, g.eps, xn1, a.rstd1);
    a.proj = f32({g.M, g.nproj}, dev);
    column_parallel_forward(tp, ops::to_compute(xn1, dt), weight(ix_.q), true, a.xn1, a.proj);
  }
  // q, k, v: the projections, or their short convolutions (the same columns of another buffer).
  const int64_t off[3] = {0, g.Kd, g.Kd + g.Kg}, width[3] = {g.Kd, g.Kg, g.Vg};
  if (c_.use_short_conv) {
    a.qkv_c = f32({g.M, g.Kd + g.Kg + g.Vg}, dev);
    for (int i = 0; i < 3; ++i) {
      Tensor dst = a.qkv_c.narrow(1, off[i], width[i]);
      if (conv_halo())
        gla_cp_short_conv_forward(par_->cp, ctx.positions, a.proj.narrow(1, off[i], width[i]),
                                  P[size_t(ix_.conv + i)].value, ctx.B, dst);
      else
        ops::short_conv_forward(a.proj.narrow(1, off[i], width[i]), P[size_t(ix_.conv + i)].value,
                                ctx.B, dst);
    }
  }
  const Tensor& src = c_.use_short_conv ? a.qkv_c : a.proj;
  const Tensor q = src.narrow(1, off[0], width[0]), k = src.narrow(1, off[1], width[1]),
               v = src.narrow(1, off[2], width[2]);
  // The low-rank gate: gk = logsigmoid(r W1^T + b1) / 16 (then clamp_min).
  a.r = f32({g.M, g.rank}, dev);
  ops::copy_rows(a.proj.narrow(1, g.nproj - g.rank, g.rank), a.r);
  a.z = f32({g.M, g.Kg}, dev);
  ops::linear(ops::to_compute(a.r, dt), weight(ix_.gk1), a.z);
  a.gk = f32({g.M, g.Kg}, dev);
  ops::gla_gate_forward(a.z, P[size_t(ix_.gb1)].value, g.normalizer, g.clamp, a.gk);

  a.o = f32({g.M, g.Vd}, dev);
  if (par_->cp.size() > 1)
    gla_cp_forward(par_->cp, {ctx.B, g.H, g.Hkv}, ctx.positions, q, k, v, a.gk, a.o, a.cp);
  else
    ops::gla_forward({ctx.B, g.H, g.Hkv}, q, k, v, a.gk, none, a.o, none);
  {
    const Tensor gate = c_.use_output_gate ? a.proj.narrow(1, g.Kd + g.Kg + g.Vg, g.Vd) : none;
    Tensor y = f32({g.M, g.Vd}, dev);
    a.rstd_o = f32({g.M * g.H}, dev);
    ops::gated_rmsnorm_forward(a.o, gate, param_or_none(ix_.gnorm), g.H, g.eps, y, a.rstd_o);
    a.y = ops::to_compute(y, dt);
  }
  a.mlp.h = row_parallel_forward(tp, a.y, weight(ix_.o), x);
  return mlp(ctx).forward(unit_, a.mlp);
}

void GlaBlock::backward(const StepContext& ctx, Tensor& dy, GlaBlockActs& a) {
  const TpRuntime& tp = par_->tp;
  const Dims g = dims(ctx);
  auto& P = unit_.params();
  const Device dev = dy.device();
  const DType dt = ctx.compute;
  Tensor none;

  if (!a.mlp.h.defined()) run_forward(ctx, ops::to_f32(a.x), a);  // `full`: everything again
  mlp(ctx).backward(unit_, dy, a.mlp);
  // Attention branch: h = x + o(norm_gate(gla(q, k, v, gate(r)), g)).
  {
    Tensor dproj = Tensor::zeros({g.M, g.nproj}, DType::f32, dev);
    Tensor dO = f32({g.M, g.Vd}, dev);
    {
      const int64_t og = g.Kd + g.Kg + g.Vg;
      const Tensor gate = c_.use_output_gate ? a.proj.narrow(1, og, g.Vd) : none;
      if (!a.y.defined()) {  // `op`: the normed, gated core output o_proj's gradient reads
        Tensor y = f32({g.M, g.Vd}, dev), rstd = f32({g.M * g.H}, dev);
        ops::gated_rmsnorm_forward(a.o, gate, param_or_none(ix_.gnorm), g.H, g.eps, y, rstd);
        a.y = ops::to_compute(y, dt);
      }
      Tensor dY = f32({g.M, g.Vd}, dev);
      row_parallel_backward(tp, dy, a.y, weight(ix_.o), unit_.weight_grad(size_t(ix_.o)), dY, dt);
      a.y = Tensor();
      Tensor dgate = c_.use_output_gate ? dproj.narrow(1, og, g.Vd) : none;
      // The head norm's weight is replicated while each rank holds its heads: its gradient is a
      // partial sum over tp (flame's plan misses it, spec 8.1), summed here into a zeroed buffer
      // so that a gradient accumulated over micro-batches is not summed twice.
      Tensor dw = ix_.gnorm < 0 ? none : P[size_t(ix_.gnorm)].grad;
      if (tp.on() && dw.defined()) {
        dw = tp_pooled(tp, dist::BufferPurpose::gla_gnorm_grad, dw.shape(), DType::f32, dev);
        dw.zero_();
      }
      ops::gated_rmsnorm_backward(dY, a.o, gate, param_or_none(ix_.gnorm), a.rstd_o, g.H, dO, dgate,
                                  dw);
      if (tp.on() && dw.defined()) {
        tp_all_reduce(tp, dw);
        ops::add_inplace(P[size_t(ix_.gnorm)].grad, dw);
      }
      a.o = a.rstd_o = Tensor();
    }
    {
      // The core's input gradients go to the projections' columns of dproj, or first to a
      // buffer that the short convolutions' backward turns into them.
      const int64_t off[3] = {0, g.Kd, g.Kd + g.Kg}, width[3] = {g.Kd, g.Kg, g.Vg};
      Tensor dsrc = c_.use_short_conv ? f32({g.M, g.Kd + g.Kg + g.Vg}, dev) : dproj;
      const Tensor& src = c_.use_short_conv ? a.qkv_c : a.proj;
      Tensor dq = dsrc.narrow(1, off[0], width[0]), dk = dsrc.narrow(1, off[1], width[1]),
             dv = dsrc.narrow(1, off[2], width[2]);
      Tensor dgk = f32({g.M, g.Kg}, dev);
      if (par_->cp.size() > 1)
        gla_cp_backward(par_->cp, {ctx.B, g.H, g.Hkv}, ctx.positions,
                        src.narrow(1, off[0], width[0]), src.narrow(1, off[1], width[1]),
                        src.narrow(1, off[2], width[2]), a.gk, a.cp, dO, dq, dk, dv, dgk);
      else
        ops::gla_backward({ctx.B, g.H, g.Hkv}, src.narrow(1, off[0], width[0]),
                          src.narrow(1, off[1], width[1]), src.narrow(1, off[2], width[2]), a.gk,
                          none, dO, none, dq, dk, dv, dgk, none);
      if (c_.use_short_conv) {
        for (int i = 0; i < 3; ++i) {
          Tensor dx = dproj.narrow(1, off[i], width[i]);
          const size_t w = size_t(ix_.conv + i);
          if (conv_halo())
            gla_cp_short_conv_backward(par_->cp, ctx.positions, dsrc.narrow(1, off[i], width[i]),
                                       a.proj.narrow(1, off[i], width[i]), P[w].value, ctx.B, dx,
                                       P[w].grad);
          else
            ops::short_conv_backward(dsrc.narrow(1, off[i], width[i]),
                                     a.proj.narrow(1, off[i], width[i]), P[w].value, ctx.B, dx,
                                     P[w].grad);
        }
        a.qkv_c = Tensor();
      }
      a.gk = Tensor();
      ops::gla_gate_backward(dgk, a.z, P[size_t(ix_.gb1)].value, g.normalizer, g.clamp, dgk,
                             P[size_t(ix_.gb1)].grad);
      Tensor dr = f32({g.M, g.rank}, dev);
      ops::linear_backward(ops::to_compute(dgk, dt), ops::to_compute(a.r, dt), weight(ix_.gk1),
                           unit_.weight_grad(size_t(ix_.gk1)), dr);
      Tensor dr_view = dproj.narrow(1, g.nproj - g.rank, g.rank);
      ops::copy_rows(dr, dr_view);
      a.z = a.r = Tensor();
    }
    // gk_proj.0 is replicated but reads this rank's partial dr: its gradient rows of the fused
    // GEMM are a partial sum over tp. They go to zeroed rows, are summed, then added back; on
    // the step's first write (unwritten, ParamUnit::zero_grad) the GEMM writes them and there is
    // nothing to add back.
    const ops::WeightGrad proj_grad = unit_.weight_grad(size_t(ix_.q), size_t(ix_.gk0 - ix_.q + 1));
    const bool add_back = tp.on() && !proj_grad.first_write();
    Tensor gk0_grad = P[size_t(ix_.gk0)].grad, gk0_before;
    if (add_back) {
      gk0_before = f32(gk0_grad.shape(), dev);
      ops::copy_rows(gk0_grad, gk0_before);
      gk0_grad.zero_();
    }
    // The saved input as the forward read it: the bf16 copy, read widened (exactly) by the norm's
    // backward; widened here only where the norm output must be recomputed from it.
    const Tensor x = a.xn1.defined() ? a.x : ops::to_f32(a.x);
    a.x = Tensor();
    Tensor dxn1;
    {
      // The tp sum of gk_proj.0's rows needs the GEMM's partial sums now: not deferred to a
      // zero-bubble schedule's W (it was, and pp2 x tp2 zb1p ended 0.7% off one process).
      std::optional<ops::WeightGradsNow> now;
      if (tp.on()) now.emplace();
      dxn1 = column_parallel_backward(
          tp, ops::to_compute(dproj, dt),
          norm_gemm_input(tp, kPrecision, dt, a.xn1, true, x, P[size_t(ix_.norm1)].value, g.eps),
          weight(ix_.q), proj_grad);
    }
    if (tp.on()) {
      tp_all_reduce(tp, gk0_grad);
      if (add_back) ops::add_inplace(gk0_grad, gk0_before);
    }
    tp_summed_norm_grad(tp, P[size_t(ix_.norm1)].grad, [&](Tensor& gw) {
      ops::rmsnorm_backward(dxn1, x, P[size_t(ix_.norm1)].value, a.rstd1, dy, gw);
    });
  }
  a = GlaBlockActs();
}

}  // namespace loom
