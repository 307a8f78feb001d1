#include "ops/ops.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cpu/attention_decode.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gated_rmsnorm.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/gla.hpp"
#include "kernels/cpu/gla_gate.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/sharded.hpp"
#include "kernels/cpu/short_conv.hpp"
#include "kernels/cpu/swiglu.hpp"

namespace loom::ops {

namespace {

// Runs the cpu kernel `fn` on the cpu device; meta books memory only (nothing to compute).
template <class Fn>
void on(const char* op, Device device, Fn&& fn) {
  switch (device) {
    case Device::cpu:
      fn();
      return;
    case Device::meta:
      return;
    default:
      fail(op, ": no kernel for device ", device_name(device));
  }
}

const float* f(const Tensor& t) {
  return t.data<float>();
}
float* f(Tensor& t) {
  return t.data<float>();
}
int64_t rows(const Tensor& t) {
  return t.size(0);
}
int64_t cols(const Tensor& t) {
  return t.numel() / t.size(0);
}
int64_t stride(const Tensor& t) {
  return t.ndim() > 1 ? t.strides()[0] : t.numel();
}
float scale(int64_t D) {
  return 1.0f / std::sqrt(float(D));
}

}  // namespace

bool computes(Device device) {
  return holds_data(device);
}

Tensor to_compute(const Tensor& x, DType dt) {
  if (dt == DType::f32) return x;
  Tensor y = Tensor::empty(x.shape(), DType::bf16, x.device());
  cast(x, y);
  return y;
}

void cast(const Tensor& src, Tensor& dst) {
  LOOM_CHECK(src.numel() == dst.numel(), "cast: ", src.numel(), " elements into ", dst.numel());
  on("cast", src.device(), [&] { cpu::cast_f32_to_bf16(f(src), dst.data<bf16>(), src.numel()); });
}

void add_inplace(Tensor& y, const Tensor& x) {
  LOOM_CHECK(y.numel() == x.numel(), "add_inplace: ", x.numel(), " elements into ", y.numel());
  on("add_inplace", y.device(), [&] { cpu::add_inplace(f(y), f(x), y.numel()); });
}

void fill(Tensor& x, float value) {
  on("fill", x.device(), [&] { cpu::fill(f(x), x.numel(), value); });
}

void copy_rows(const Tensor& src, Tensor& dst) {
  LOOM_CHECK(rows(src) == rows(dst) && src.size(1) == dst.size(1),
             "copy_rows: ", shape_str(src.shape()), " into ", shape_str(dst.shape()));
  on("copy_rows", src.device(),
     [&] { cpu::copy_rows(f(src), stride(src), f(dst), stride(dst), rows(src), src.size(1)); });
}

void philox_normal(Tensor& x, uint64_t key, int64_t first, float std) {
  on("philox_normal", x.device(),
     [&] { loom::philox_normal(key, first, x.numel(), 0.0f, std, f(x)); });
}

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  on("linear", y.device(), [&] {
    cpu::linear_forward(x.raw(), w.raw(), f(y), rows(x), cols(y), cols(x), x.dtype(), accumulate);
  });
}

namespace {
thread_local std::vector<DeferredWeightGrad>* g_deferred = nullptr;
thread_local bool g_copy_inputs = false;

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  c.copy_from(t);
  return c;
}
}  // namespace

DeferWeightGrads::DeferWeightGrads(std::vector<DeferredWeightGrad>& into, bool copy_inputs) {
  LOOM_CHECK(!g_deferred, "DeferWeightGrads: already deferring on this thread");
  g_deferred = &into;
  g_copy_inputs = copy_inputs;
}
DeferWeightGrads::~DeferWeightGrads() {
  g_deferred = nullptr;
  g_copy_inputs = false;
}

void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dw, Tensor& dx) {
  on("linear_backward", dy.device(), [&] {
    const int64_t M = rows(dy), N = cols(dy), K = cols(x);
    cpu::linear_backward_input(dy.raw(), w.raw(), f(dx), M, N, K, dy.dtype(), false);
    if (g_deferred) {
      g_deferred->push_back({copy_of(dy), g_copy_inputs ? copy_of(x) : x, dw});
      return;
    }
    cpu::linear_backward_weight(dy.raw(), x.raw(), f(dw), M, N, K, dy.dtype());
  });
}

void run_weight_grads(std::vector<DeferredWeightGrad>& list) {
  for (DeferredWeightGrad& d : list) {
    on("linear_backward_weight", d.dy.device(), [&] {
      cpu::linear_backward_weight(d.dy.raw(), d.x.raw(), f(d.dw), rows(d.dy), cols(d.dy), cols(d.x),
                                  d.dy.dtype());
    });
  }
  list.clear();
}

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  on("rmsnorm_forward", x.device(), [&] {
    if (y.dtype() == DType::bf16)
      cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, y.data<bf16>(), f(rstd));
    else
      cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, f(y), f(rstd));
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  on("rmsnorm_backward", x.device(),
     [&] { cpu::rmsnorm_backward(f(dy), f(x), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw)); });
}

void swiglu_forward(const Tensor& gu, Tensor& act) {
  on("swiglu_forward", gu.device(), [&] {
    if (act.dtype() == DType::bf16)
      cpu::swiglu_forward(f(gu), rows(gu), cols(act), act.data<bf16>());
    else
      cpu::swiglu_forward(f(gu), rows(gu), cols(act), f(act));
  });
}

void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) {
  on("swiglu_backward", gu.device(),
     [&] { cpu::swiglu_backward(f(dact), f(gu), rows(gu), cols(dact), f(dgu)); });
}

void rope_forward(Tensor& x, int64_t B, int64_t H, const std::vector<int32_t>& positions,
                  const RopeTable& table) {
  on("rope_forward", x.device(), [&] {
    const int64_t T = rows(x) / B;
    cpu::rope_forward(f(x), B, T, H, x.size(1) / H, stride(x), positions.data(), table);
  });
}

void rope_backward(Tensor& dx, int64_t B, int64_t H, const std::vector<int32_t>& positions,
                   const RopeTable& table) {
  on("rope_backward", dx.device(), [&] {
    const int64_t T = rows(dx) / B;
    cpu::rope_backward(f(dx), B, T, H, dx.size(1) / H, stride(dx), positions.data(), table);
  });
}

RopeTable rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s) {
  // A host table: every backend's rope kernel reads positions' cos/sin from it.
  return cpu::rope_table(head_dim, num_positions, theta, s);
}

void embedding_forward(const int32_t* tokens, const Tensor& table, Tensor& out) {
  on("embedding_forward", out.device(), [&] {
    cpu::embedding_forward(tokens, rows(out), f(table), rows(table), table.size(1), f(out));
  });
}

void embedding_backward(const int32_t* tokens, const Tensor& dout, Tensor& dtable) {
  on("embedding_backward", dout.device(), [&] {
    cpu::embedding_backward(tokens, rows(dout), f(dout), rows(dtable), dtable.size(1), f(dtable));
  });
}

void embedding_forward_range(const int32_t* tokens, const Tensor& table, int64_t v0, Tensor& out) {
  on("embedding_forward_range", out.device(), [&] {
    cpu::embedding_forward_range(tokens, rows(out), f(table), v0, rows(table), table.size(1),
                                 f(out));
  });
}

void embedding_backward_range(const int32_t* tokens, const Tensor& dout, int64_t v0,
                              Tensor& dtable) {
  on("embedding_backward_range", dout.device(), [&] {
    cpu::embedding_backward_range(tokens, rows(dout), f(dout), v0, rows(dtable), dtable.size(1),
                                  f(dtable));
  });
}

namespace {

cpu::AttentionShape attention_shape(const Tensor& q, const Tensor& k, int64_t B, int64_t Hq,
                                    int64_t Hkv) {
  const int64_t D = q.size(1) / Hq;
  return {B, rows(q) / B, Hq, Hkv, D, stride(q), stride(k), scale(D)};
}

cpu::BlockShape block_shape(const AttentionBlock& s, const Tensor& q, const Tensor& k) {
  const int64_t D = q.size(1) / s.Hq;
  return {s.B,
          int64_t(s.q_pos->size()),
          int64_t(s.k_pos->size()),
          s.Hq,
          s.Hkv,
          D,
          stride(q),
          stride(k),
          scale(D)};
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                       int64_t Hkv, Tensor& out, Tensor& lse) {
  on("attention_forward", q.device(), [&] {
    cpu::attention_forward(attention_shape(q, k, B, Hq, Hkv), f(q), f(k), f(v), f(out), f(lse));
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
  on("attention_backward", q.device(), [&] {
    cpu::attention_backward(attention_shape(q, k, B, Hq, Hkv), f(q), f(k), f(v), f(out), f(lse),
                            f(dout), f(dq), f(dk), f(dv));
  });
}

void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                      int64_t Hkv, Tensor& out) {
  on("attention_decode", q.device(), [&] {
    const int64_t D = q.size(1) / Hq;
    cpu::DecodeShape s{rows(q), L, Hq, Hkv, D, stride(q), stride(k), scale(D)};
    cpu::attention_decode(s, f(q), f(k), f(v), f(out));
  });
}

void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                             const Tensor& v, Tensor& out, Tensor& lse,
                             const std::function<void()>& progress) {
  on("attention_block_forward", q.device(), [&] {
    cpu::attention_block_forward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                 s.k_pos->data(), f(out), f(lse), progress);
  });
}

void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& lse, const Tensor& delta,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const std::function<void()>& progress) {
  on("attention_block_backward", q.device(), [&] {
    cpu::attention_block_backward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                  s.k_pos->data(), f(lse), f(delta), f(dout), f(dq), f(dk), f(dv),
                                  progress);
  });
}

void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b) {
  on("attention_merge", out.device(), [&] {
    const int64_t T = rows(out) / B;
    cpu::attention_merge(B, T, Hq, out.size(1) / Hq, f(out), f(lse), f(out_b), f(lse_b));
  });
}

void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout, Tensor& delta) {
  on("attention_delta", out.device(), [&] {
    const int64_t T = rows(out) / B;
    cpu::attention_delta(B, T, Hq, out.size(1) / Hq, f(out), f(dout), f(delta));
  });
}

namespace {

cpu::GlaCore gla_core(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& gk, const Tensor& h0) {
  cpu::GlaCore a;
  a.B = s.B, a.T = rows(q) / s.B, a.H = s.H, a.Hkv = s.Hkv;
  a.K = q.size(1) / s.H, a.V = v.size(1) / s.Hkv;
  a.scale = scale(a.K);
  a.chunk = s.chunk, a.sub_chunk = s.sub_chunk;
  a.q = {f(q), stride(q)}, a.k = {f(k), stride(k)}, a.v = {f(v), stride(v)};
  a.gk = {f(gk), stride(gk)};
  a.h0 = h0.defined() ? f(h0) : nullptr;
  return a;
}

float* f_or_null(Tensor& t) {
  return t.defined() ? f(t) : nullptr;
}
const float* f_or_null(const Tensor& t) {
  return t.defined() ? f(t) : nullptr;
}

void check_gla(const char* op, const Gla& s, const Tensor& q) {
  LOOM_CHECK(s.B > 0 && s.H > 0 && rows(q) % s.B == 0 && q.size(1) % s.H == 0, op, ": q ",
             shape_str(q.shape()), " does not split into B ", s.B, " samples and H ", s.H,
             " heads");
}

}  // namespace

void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                 const Tensor& h0, Tensor& o, Tensor& ht) {
  check_gla("gla_forward", s, q);
  on("gla_forward", q.device(), [&] {
    cpu::gla_forward(gla_core(s, q, k, v, gk, h0), {f(o), stride(o)}, f_or_null(ht));
  });
}

void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                  const Tensor& h0, const Tensor& dout, const Tensor& dht, Tensor& dq, Tensor& dk,
                  Tensor& dv, Tensor& dgk, Tensor& dh0) {
  check_gla("gla_backward", s, q);
  on("gla_backward", q.device(), [&] {
    cpu::GlaCoreGrads g{{f(dq), stride(dq)},
                        {f(dk), stride(dk)},
                        {f(dv), stride(dv)},
                        {f(dgk), stride(dgk)},
                        f_or_null(dh0)};
    cpu::gla_backward(gla_core(s, q, k, v, gk, h0), {f(dout), stride(dout)}, f_or_null(dht), g);
  });
}

void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay) {
  LOOM_CHECK(gk.is_contiguous() && decay.numel() == s.B * gk.size(1), "gla_decay_total: gk ",
             shape_str(gk.shape()), " must be contiguous, decay ", shape_str(decay.shape()),
             " must hold B * its columns");
  on("gla_decay_total", gk.device(), [&] {
    cpu::gla_decay_total(s.B, rows(gk) / s.B, s.Hkv, gk.size(1) / s.Hkv, f(gk), f(decay));
  });
}

void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S) {
  LOOM_CHECK(S.ndim() == 4 && E.numel() == S.numel() && S.is_contiguous() && E.is_contiguous(),
             "gla_state_fold: S ", shape_str(S.shape()), " and E ", shape_str(E.shape()),
             " must be contiguous [B, H, K, V]");
  on("gla_state_fold", S.device(),
     [&] { cpu::gla_state_fold(s.B, s.H, s.Hkv, S.size(2), S.size(3), f(decay), f(E), f(S)); });
}

void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer, float clamp_min,
                      Tensor& gk) {
  LOOM_CHECK(z.is_contiguous() && gk.is_contiguous() && z.numel() == gk.numel(),
             "gla_gate_forward: z ", shape_str(z.shape()), " and gk ", shape_str(gk.shape()),
             " must be contiguous and the same size");
  on("gla_gate_forward", z.device(), [&] {
    cpu::gla_gate_forward(f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min, f(gk));
  });
}

void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias, float normalizer,
                       float clamp_min, Tensor& dz, Tensor& dbias) {
  LOOM_CHECK(z.is_contiguous() && dgk.is_contiguous() && dz.is_contiguous() &&
                 z.numel() == dgk.numel() && z.numel() == dz.numel(),
             "gla_gate_backward: z, dgk and dz must be contiguous and the same size, got ",
             shape_str(z.shape()), ", ", shape_str(dgk.shape()), ", ", shape_str(dz.shape()));
  on("gla_gate_backward", z.device(), [&] {
    cpu::gla_gate_backward(f(dgk), f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min,
                           f(dz), bias.defined() ? f(dbias) : nullptr);
  });
}

void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w, int64_t heads,
                           float eps, Tensor& y, Tensor& rstd) {
  LOOM_CHECK(heads > 0 && x.is_contiguous() && y.is_contiguous() && cols(x) % heads == 0,
             "gated_rmsnorm_forward: x ", shape_str(x.shape()),
             " must be contiguous and split into ", heads, " heads");
  on("gated_rmsnorm_forward", x.device(), [&] {
    const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, eps};
    cpu::gated_rmsnorm_forward(s, f(x), f_or_null(g), g.defined() ? stride(g) : 0, f_or_null(w),
                               f(y), f(rstd));
  });
}

void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& w,
                            const Tensor& rstd, int64_t heads, Tensor& dx, Tensor& dg, Tensor& dw) {
  LOOM_CHECK(heads > 0 && x.is_contiguous() && dy.is_contiguous() && dx.is_contiguous() &&
                 cols(x) % heads == 0,
             "gated_rmsnorm_backward: x ", shape_str(x.shape()),
             " must be contiguous and split into ", heads, " heads");
  on("gated_rmsnorm_backward", x.device(), [&] {
    const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, 0.0f};  // eps is in rstd
    cpu::gated_rmsnorm_backward(s, f(dy), f(x), f_or_null(g), g.defined() ? stride(g) : 0,
                                f_or_null(w), f(rstd), f(dx), g.defined() ? f(dg) : nullptr,
                                g.defined() ? stride(dg) : 0, w.defined() ? f(dw) : nullptr);
  });
}

void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, "short_conv_forward: ", rows(x),
             " rows do not split into B ", B, " samples");
  on("short_conv_forward", x.device(), [&] {
    const int64_t C = x.size(1);
    const cpu::ShortConv s{B, rows(x) / B, C, w.numel() / C};
    cpu::short_conv_forward(s, f(x), stride(x), f(w), f(y), stride(y));
  });
}

void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B, Tensor& dx,
                         Tensor& dw) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, "short_conv_backward: ", rows(x),
             " rows do not split into B ", B, " samples");
  on("short_conv_backward", x.device(), [&] {
    const int64_t C = x.size(1);
    const cpu::ShortConv s{B, rows(x) / B, C, w.numel() / C};
    cpu::short_conv_backward(s, f(dy), stride(dy), f(x), stride(x), f(w), f(dx), stride(dx), f(dw));
  });
}

double linear_cross_entropy(const LinearCrossEntropy& a) {
  if (a.x.device() == Device::meta && rows(a.x) > 0) {
    // The kernel's scratch for one chunk, alive for the call (the real run's allocator counts it).
    const int64_t chunk = cpu::linear_cross_entropy_chunk(rows(a.x), a.V, a.chunk_rows);
    const MemoryUseScope use(Device::meta, MemoryUse::loss);
    Tensor logits = Tensor::empty({chunk, a.V}, DType::f32, Device::meta);
    Tensor grad16 = a.x.dtype() == DType::bf16 && (a.dx.defined() || a.dw.defined())
                        ? Tensor::empty({chunk, a.V}, DType::bf16, Device::meta)
                        : Tensor();
  }
  double loss = 0;
  on("linear_cross_entropy", a.x.device(), [&] {
    cpu::LinearCrossEntropyArgs ce;
    ce.x = a.x.raw();
    ce.w = a.w.raw();
    ce.ab = a.x.dtype();
    ce.targets = a.targets;
    ce.N = rows(a.x);
    ce.D = cols(a.x);
    ce.V = a.V;
    ce.grad_scale = a.grad_scale;
    ce.dx = a.dx.defined() ? a.dx.data<float>() : nullptr;
    ce.dw = a.dw.defined() ? a.dw.data<float>() : nullptr;
    ce.chunk_rows = a.chunk_rows;
    loss = cpu::linear_cross_entropy(ce);
  });
  return loss;
}

void vocab_shard_lse(const Tensor& logits, int64_t Vr, const int32_t* targets, int64_t v0,
                     Tensor& lse, Tensor& target_logit) {
  on("vocab_shard_lse", logits.device(), [&] {
    cpu::vocab_shard_lse(f(logits), rows(logits), cols(logits), Vr, targets, v0, f(lse),
                         f(target_logit));
  });
}

double vocab_shard_combine(const Tensor& lse_all, const int32_t* targets,
                           const Tensor& target_logit, Tensor& glse) {
  double loss = 0;
  on("vocab_shard_combine", lse_all.device(), [&] {
    loss = cpu::vocab_shard_combine(f(lse_all), int(rows(lse_all)), cols(lse_all), targets,
                                    f(target_logit), f(glse));
  });
  return loss;
}

void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const int32_t* targets, int64_t v0,
                         const Tensor& glse, float grad_scale) {
  on("vocab_shard_dlogits", logits.device(), [&] {
    cpu::vocab_shard_dlogits(f(logits), rows(logits), cols(logits), Vr, targets, v0, f(glse),
                             grad_scale);
  });
}

}  // namespace loom::ops

namespace loom::ops {
// TEMPORARY until the meta work recording lands (h5/hw): records nothing.
RecordWork::RecordWork(std::function<void(const KernelWork&)>) {}
RecordWork::~RecordWork() = default;
}  // namespace loom::ops
