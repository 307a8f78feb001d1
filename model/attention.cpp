#include "model/attention.hpp"

#include "ops/ops.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

size_t AttentionActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&x, &rstd1, &xn1, &qkv, &attn, &lse, &qk, &qk_rstd})
    if (t->defined()) n += t->nbytes();
  return n;
}

Attention Attention::of(const ParallelContext& par, const StepContext& ctx, size_t norm, size_t q,
                        size_t o, size_t qk_norm, size_t qkv_bias, int64_t d, int64_t hd,
                        int64_t heads, int64_t kv_heads, float eps) {
  const TpRuntime& tp = par.tp;
  const int tpn = tp.on() ? tp.opt.size() : 1;
  const int64_t M = ctx.tokens();
  return {.par = par,
          .norm = norm,
          .q = q,
          .o = o,
          .qk_norm = qk_norm,
          .qkv_bias = qkv_bias,
          .M = M,
          .Mx = tp.sp() ? M / tpn : M,
          .d = d,
          .hd = hd,
          .Hq = heads / tpn,
          .Hkv = kv_heads / tpn,
          .eps = eps,
          .compute = ctx.compute,
          .keep_gathered = !tp.opt.recompute_allgather};
}

void Attention::add_biases(const ParamUnit& unit, Tensor& qkv) const {
  const auto& P = unit.params();
  int64_t col = 0;
  for (int64_t i = 0; i < 3; ++i) {
    const int64_t n = (i == 0 ? Hq : Hkv) * hd;
    Tensor cols = qkv.narrow(1, col, n);
    ops::add_bias(cols, P[qkv_bias + size_t(i)].value);
    col += n;
  }
}

void Attention::bias_grads(ParamUnit& unit, const Tensor& dqkv) const {
  auto& P = unit.params();
  int64_t col = 0;
  for (int64_t i = 0; i < 3; ++i) {
    const int64_t n = (i == 0 ? Hq : Hkv) * hd;
    ops::bias_grad(dqkv.narrow(1, col, n), P[qkv_bias + size_t(i)].grad);
    col += n;
  }
}

// Qwen3's q/k norms on the f32 GEMM output, in place: each head of q (and of k) over head_dim,
// before RoPE. Their inputs are saved (contiguous, as the norm kernel reads them).
void Attention::qk_norm_forward(const ParamUnit& unit, Tensor& qkv, AttentionActs& a) const {
  const Device dev = qkv.device();
  const auto& P = unit.params();
  a.qk = f32({M, (Hq + Hkv) * hd}, dev);
  a.qk_rstd = f32({M * (Hq + Hkv)}, dev);
  int64_t col = 0, row = 0;
  for (auto [heads, w] : {std::pair{Hq, qk_norm}, std::pair{Hkv, qk_norm + 1}}) {
    Tensor raw = f32({M, heads * hd}, dev), y = f32({M, heads * hd}, dev);
    Tensor view = qkv.narrow(1, col, heads * hd);
    ops::copy_rows(view, raw);
    Tensor rstd = a.qk_rstd.narrow(0, row, M * heads);
    ops::gated_rmsnorm_forward(raw, Tensor(), P[w].value, heads, eps, y, rstd);
    ops::copy_rows(y, view);
    Tensor saved = a.qk.narrow(1, col, heads * hd);
    ops::copy_rows(raw, saved);
    col += heads * hd;
    row += M * heads;
  }
}

// dq and dk (f32, in dqkv, rotated back) through the norms, in place; the norms' weight
// gradients accumulate.
void Attention::qk_norm_backward(ParamUnit& unit, Tensor& dqkv, AttentionActs& a) const {
  const Device dev = dqkv.device();
  auto& P = unit.params();
  int64_t col = 0, row = 0;
  // Not a structured binding: clang (before 16) refuses to capture one in the lambda below.
  for (const auto& hw : {std::pair{Hq, qk_norm}, std::pair{Hkv, qk_norm + 1}}) {
    const auto heads = hw.first;
    const auto w = hw.second;
    Tensor dy = f32({M, heads * hd}, dev), raw = f32({M, heads * hd}, dev),
           dx = f32({M, heads * hd}, dev), none;
    Tensor view = dqkv.narrow(1, col, heads * hd);
    ops::copy_rows(view, dy);
    ops::copy_rows(a.qk.narrow(1, col, heads * hd), raw);
    // The norm's weight is replicated while each tp rank holds its heads: a partial gradient.
    tp_summed_weight_grad(par.tp, P[w].grad, [&](const ops::WeightGrad& dw) {
      Tensor g = dw.t;
      ops::gated_rmsnorm_backward(dy, raw, Tensor(), P[w].value,
                                  a.qk_rstd.narrow(0, row, M * heads), heads, dx, none, g);
    });
    ops::copy_rows(dx, view);
    col += heads * hd;
    row += M * heads;
  }
  a.qk = a.qk_rstd = Tensor();
}

// RoPE on q and k, then causal attention (ring attention across cp ranks). qkv is the f32 GEMM
// output; a.qkv and a.attn keep it and the attention output in the compute dtype. In bf16 the
// attention reads qkv rounded, so that its backward (which reads the saved bf16 copy)
// differentiates the function the forward computed: the bf16 kernels read that copy itself;
// ring attention (f32 kernels) reads qkv rounded in place.
void Attention::attend(const StepContext& ctx, Tensor& qkv, AttentionActs& a) const {
  const Device dev = qkv.device();
  const bool ring = par.cp.size() > 1, bf16 = ctx.compute == DType::bf16;
  // The bf16 kernels write the attention output rounded, what is saved; ring attention's merge
  // needs it in f32 (rounded after).
  Tensor attn =
      bf16 && !ring ? Tensor::empty({M, Hq * hd}, DType::bf16, dev) : f32({M, Hq * hd}, dev);
  {
    if (bf16 && !ring) {
      // The bf16 kernels read only the rounded copy: q and k rotated as they are rounded.
      a.qkv = Tensor::empty({M, nqkv()}, DType::bf16, dev);
      ops::rope_rounded(qkv, ctx.B, Hq + Hkv, Hkv, ctx.positions_device, *ctx.rope, false, a.qkv);
    } else {
      Tensor q = qkv.narrow(1, 0, Hq * hd), k = qkv.narrow(1, Hq * hd, Hkv * hd);
      ops::rope_forward(q, ctx.B, Hq, ctx.positions_device, *ctx.rope);
      ops::rope_forward(k, ctx.B, Hkv, ctx.positions_device, *ctx.rope);
      a.qkv = ops::to_compute(qkv, ctx.compute);
      if (ctx.compute != DType::f32 && ring) ops::cast(a.qkv, qkv);
    }
    a.lse = f32({ctx.B, Hq, ctx.T}, dev);
    const Tensor& in = bf16 && !ring ? a.qkv : qkv;
    if (ring)
      ring_attention_forward(par.cp, {ctx.B, ctx.T, Hq, Hkv, hd, &ctx.cp_pos, &ctx.cp_pos_device},
                             qkv, attn, a.lse);
    else
      ops::attention_forward(in.narrow(1, 0, Hq * hd), in.narrow(1, Hq * hd, Hkv * hd),
                             in.narrow(1, (Hq + Hkv) * hd, Hkv * hd), ctx.B, Hq, Hkv, attn, a.lse);
  }
  qkv = Tensor();  // the f32 copy goes before the rounded output is made
  a.attn = attn.dtype() == ctx.compute ? attn : ops::to_compute(attn, ctx.compute);
}

// In bf16 without cp, dq and dk come out not yet rotated back: the caller rotates them as it rounds
// dqkv for the GEMM. Not with q/k norms or biases: their backward reads dq and dk rotated back.
bool Attention::unrotated_dqkv(const StepContext& ctx) const {
  return par.cp.size() == 1 && ctx.compute == DType::bf16 && qk_norm == kNone && qkv_bias == kNone;
}

void Attention::attend_backward(const StepContext& ctx, AttentionActs& a, const Tensor& dattn,
                                Tensor& dqkv) const {
  const int64_t qc = Hq * hd, kc = Hkv * hd;
  Tensor dq = dqkv.narrow(1, 0, qc), dk = dqkv.narrow(1, qc, kc), dv = dqkv.narrow(1, qc + kc, kc);
  if (par.cp.size() == 1 && ctx.compute == DType::bf16) {
    // The bf16 kernels read the saved bf16 qkv and attention output themselves.
    ops::attention_backward(a.qkv.narrow(1, 0, qc), a.qkv.narrow(1, qc, kc),
                            a.qkv.narrow(1, qc + kc, kc), a.attn, a.lse, dattn, ctx.B, Hq, Hkv, dq,
                            dk, dv);
    a.qkv = Tensor();
    a.attn = Tensor();
    if (unrotated_dqkv(ctx)) return;
  } else {
    // Ring attention's kernels read f32: the saved bf16 copies widened (exactly), each freed as
    // soon as it is.
    const Tensor qkv = ops::to_f32(a.qkv);
    a.qkv = Tensor();
    const Tensor attn = ops::to_f32(a.attn);
    a.attn = Tensor();
    if (par.cp.size() > 1)
      ring_attention_backward(par.cp, {ctx.B, ctx.T, Hq, Hkv, hd, &ctx.cp_pos, &ctx.cp_pos_device},
                              qkv, attn, a.lse, dattn, dqkv);
    else
      ops::attention_backward(qkv.narrow(1, 0, qc), qkv.narrow(1, qc, kc),
                              qkv.narrow(1, qc + kc, kc), attn, a.lse, dattn, ctx.B, Hq, Hkv, dq,
                              dk, dv);
  }
  ops::rope_backward(dq, ctx.B, Hq, ctx.positions_device, *ctx.rope);
  ops::rope_backward(dk, ctx.B, Hkv, ctx.positions_device, *ctx.rope);
}

Tensor Attention::forward(const ParamUnit& unit, const StepContext& ctx, const Tensor& x,
                          AttentionActs& a, ActivationCheckpoint::Mode mode,
                          bool round_input) const {
  const auto& P = unit.params();
  const Device dev = x.device();
  const DType dt = ctx.compute;
  // `op` drops the norm output after its GEMM; backward recomputes it (and, with SP, gathers it
  // again, as with recompute_allgather). Neither `op` nor `full` keeps a gathered GEMM input: it
  // goes to the pooled buffer.
  const bool op = mode == ActivationCheckpoint::Mode::op;
  const bool keep = keep_gathered && mode == ActivationCheckpoint::Mode::none;

  a.rstd1 = f32({Mx}, dev);
  {
    // In bf16 the norm rounds its output itself: the GEMM reads only the bf16 copy.
    Tensor xn1 = Tensor::empty({Mx, d}, dt, dev);
    if (round_input) {
      Tensor rounded = x;
      ops::rmsnorm_forward_rounding_input(rounded, a.x, P[norm].value, eps, xn1, a.rstd1);
    } else {
      ops::rmsnorm_forward(x, P[norm].value, eps, xn1, a.rstd1);
    }
    Tensor qkv = f32({M, nqkv()}, dev);
    column_parallel_forward(par.tp, xn1, unit.gemm_weight(q), keep, a.xn1, qkv);
    if (op) a.xn1 = Tensor();
    if (qkv_bias != kNone) add_biases(unit, qkv);
    if (qk_norm != kNone) qk_norm_forward(unit, qkv, a);
    attend(ctx, qkv, a);
  }
  return row_parallel_forward(par.tp, a.attn, unit.gemm_weight(o), x);
}

void Attention::backward(ParamUnit& unit, const StepContext& ctx, Tensor& dy,
                         AttentionActs& a) const {
  const TpRuntime& tp = par.tp;
  auto& P = unit.params();
  const Device dev = dy.device();
  const DType dt = ctx.compute;
  Tensor dqkv = f32({M, nqkv()}, dev);
  {
    Tensor dattn = f32({M, Hq * hd}, dev);
    row_parallel_backward(tp, dy, a.attn, unit.gemm_weight(o), unit.weight_grad(o), dattn, dt);
    attend_backward(ctx, a, dattn, dqkv);
    a.lse = Tensor();
  }
  if (qk_norm != kNone) qk_norm_backward(unit, dqkv, a);
  if (qkv_bias != kNone) bias_grads(unit, dqkv);
  // The saved input as the forward read it: the bf16 copy, read widened (exactly) by the norm's
  // backward; widened here only where the norm output must be recomputed from it.
  const Tensor x = a.xn1.defined() ? a.x : ops::to_f32(a.x);
  a.x = Tensor();
  Tensor dqkv_c;
  if (unrotated_dqkv(ctx)) {
    dqkv_c = Tensor::empty({M, nqkv()}, DType::bf16, dev);
    ops::rope_rounded(dqkv, ctx.B, Hq + Hkv, Hkv, ctx.positions_device, *ctx.rope, true, dqkv_c);
  } else {
    dqkv_c = ops::to_compute(dqkv, dt);
  }
  Tensor dxn1 = column_parallel_backward(
      tp, dqkv_c, norm_gemm_input(tp, kPrecision, dt, a.xn1, keep_gathered, x, P[norm].value, eps),
      unit.gemm_weight(q), unit.weight_grad(q, 3));
  dqkv_c = Tensor();
  dqkv = Tensor();
  a.xn1 = Tensor();
  tp_summed_norm_grad(tp, P[norm].grad, [&](Tensor& gw) {
    ops::rmsnorm_backward(dxn1, x, P[norm].value, a.rstd1, dy, gw);
  });
  a = AttentionActs();
}

}  // namespace loom
