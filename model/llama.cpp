#include "model/llama.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>

#include "distributed/process_group.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/rope.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "model/safetensors.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

bool live(const Tensor& t) {
  return t.device() != Device::meta;
}

// A GEMM input in the compute dtype: the tensor itself in f32, a rounded copy in bf16.
Tensor to_compute(const Tensor& x, DType dt) {
  if (dt == DType::f32) return x;
  Tensor y = Tensor::empty(x.shape(), DType::bf16, x.device());
  if (live(x)) cpu::cast_f32_to_bf16(x.data<float>(), y.data<bf16>(), x.numel());
  return y;
}

// y[M,N] (+)= x[M,K] * w[N,K]^T
void linear(const Tensor& x, const void* w, Tensor& y, int64_t N, int64_t K, DType dt,
            bool accumulate) {
  if (live(y))
    cpu::linear_forward(x.raw(), w, y.data<float>(), x.numel() / K, N, K, dt, accumulate);
}

// dx = dy * w, dw += dy^T x for y = x w^T with x [M,K], w [N,K].
void linear_backward(const Tensor& dy, const Tensor& x, const void* w, float* dw, Tensor* dx,
                     int64_t N, int64_t K, DType dt) {
  if (!live(dy)) return;
  int64_t M = dy.numel() / N;
  if (dx) cpu::linear_backward_input(dy.raw(), w, dx->data<float>(), M, N, K, dt, false);
  cpu::linear_backward_weight(dy.raw(), x.raw(), dw, M, N, K, dt);
}

// Collectives of tensor parallelism (skipped on the meta device, where nothing runs).
void tp_all_reduce(const TpRuntime& tp, Tensor& t) {
  if (live(t)) tp.opt.group->all_reduce(t.view({t.numel()}), dist::ReduceOp::sum)->wait();
}

// The rows of every tp rank, in rank order: [n rows, cols] -> out [tp n rows, cols].
void tp_gather_rows(const TpRuntime& tp, const Tensor& in, Tensor& out) {
  if (live(in)) tp.opt.group->all_gather(in.view({in.numel()}), out.view({out.numel()}))->wait();
}

// This rank's rows of the sum over tp ranks: [tp n rows, cols] -> out [n rows, cols].
void tp_reduce_scatter_rows(const TpRuntime& tp, const Tensor& in, Tensor& out) {
  if (live(in))
    tp.opt.group
        ->reduce_scatter(in.view({in.numel()}), out.view({out.numel()}), dist::ReduceOp::sum)
        ->wait();
}

Tensor pooled(const TpRuntime& tp, const std::string& purpose, const Shape& shape, DType dt,
              Device dev) {
  if (dev == Device::meta) return Tensor::empty(shape, dt, dev);
  return tp.pool->get(purpose, dt, shape_numel(shape), dev).view(shape);
}

// A norm's weight gradient when every tp rank normed different rows (sequence parallel): the
// rank's part goes into a zeroed buffer, the sum over tp is added to the gradient, so a gradient
// accumulated over micro-batches is not summed twice.
template <class Fn>
void tp_summed_norm_grad(const TpRuntime& tp, float* grad, int64_t d, Device dev, Fn&& fn) {
  if (!tp.sp()) {
    fn(grad);
    return;
  }
  Tensor part = pooled(tp, "norm_grad", {d}, DType::f32, dev);
  if (dev != Device::meta) part.zero_();
  fn(dev == Device::meta ? nullptr : part.data<float>());
  tp_all_reduce(tp, part);
  if (dev == Device::meta) return;
  const float* p = part.data<float>();
  for (int64_t i = 0; i < d; ++i) grad[i] += p[i];
}

// Context parallelism: ring attention over the cp group (docs/design.md "Context parallel").
// K and V of this rank's tokens are packed into kv [M, 2*Hkv*hd] (k heads then v heads) so one
// message carries both; the block kernel reads them with kv_stride = 2*Hkv*hd.
void pack_kv(const float* qkv, int64_t M, int64_t nqkv, int64_t off, int64_t w, float* kv) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) std::copy_n(qkv + m * nqkv + off, w, kv + m * w);
}
void unpack_kv(const float* kv, int64_t M, int64_t nqkv, int64_t off, int64_t w, float* qkv) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) std::copy_n(kv + m * w, w, qkv + m * nqkv + off);
}

struct RingDims {
  int64_t Hq, Hkv, hd, nqkv;
  cpu::BlockShape block(const StepContext& ctx) const {
    return {ctx.B, ctx.T, ctx.T, Hq, Hkv, hd, nqkv, 2 * Hkv * hd, 1.0f / std::sqrt(float(hd))};
  }
};

// Whether the queries of this rank see any key of cp rank `src` (with the zigzag layout always;
// the kernel itself skips the masked entries of a block without computing their scores).
// Some query of rank r sees some key of rank src exactly when the earliest key comes no later than
// the latest query: O(T) per block pair instead of counting every causal entry.
bool block_has_work(const StepContext& ctx, int r, int src) {
  const auto& q = ctx.cp_pos[r];
  const auto& k = ctx.cp_pos[src];
  return *std::min_element(k.begin(), k.end()) <= *std::max_element(q.begin(), q.end());
}

// The block kernel calls this between its work units: Open MPI moves the data of nonblocking
// send/recv only inside MPI calls, so without polling a transfer posted before the block would
// happen in the wait after it, not during it.
std::function<void()> in_flight(std::vector<dist::Work*> works) {
  return [works = std::move(works)] {
    for (dist::Work* w : works)
      if (w) w->test();
  };
}

void ring_attention_forward(const StepContext& ctx, const CpOptions& cp, const RingDims& g,
                            const float* qkv, float* out, float* lse) {
  dist::ProcessGroup& grp = *cp.group;
  const int n = cp.size(), r = cp.rank();
  const int64_t M = ctx.B * ctx.T, kvw = 2 * g.Hkv * g.hd, Hq = g.Hq, hd = g.hd;
  const cpu::BlockShape bs = g.block(ctx);
  std::fill_n(out, M * Hq * hd, 0.0f);
  std::fill_n(lse, ctx.B * Hq * ctx.T, -std::numeric_limits<float>::infinity());
  Tensor bo = f32({M, Hq * hd}, Device::cpu), bl = f32({ctx.B * Hq * ctx.T}, Device::cpu);
  auto consume = [&](const float* kv, int src, const std::function<void()>& progress = {}) {
    if (!block_has_work(ctx, r, src)) return;
    cpu::attention_block_forward(bs, qkv, kv, kv + g.Hkv * hd, ctx.cp_pos[r].data(),
                                 ctx.cp_pos[src].data(), bo.data<float>(), bl.data<float>(),
                                 progress);
    cpu::attention_merge(ctx.B, ctx.T, Hq, hd, out, lse, bo.data<float>(), bl.data<float>());
  };
  if (cp.allgather) {
    Tensor all = f32({n, M, kvw}, Device::cpu);
    pack_kv(qkv, M, g.nqkv, Hq * hd, kvw, all[r].data<float>());
    grp.all_gather(all[r], all)->wait();
    for (int s = 0; s < n; ++s) consume(all[s].data<float>(), s);
    return;
  }
  Tensor cur = f32({M, kvw}, Device::cpu), nxt = f32({M, kvw}, Device::cpu);
  pack_kv(qkv, M, g.nqkv, Hq * hd, kvw, cur.data<float>());
  for (int i = 0; i < n; ++i) {
    // The next block's transfer is in flight while this one is computed.
    std::unique_ptr<dist::Work> sw, rw;
    if (i + 1 < n) {
      sw = grp.send(cur, (r + 1) % n, i);
      rw = grp.recv(nxt, (r + n - 1) % n, i);
    }
    consume(cur.data<float>(), (r + n - i) % n, in_flight({sw.get(), rw.get()}));
    if (sw) {
      sw->wait();
      rw->wait();
      std::swap(cur, nxt);
    }
  }
}

// dqkv [M, nqkv] is overwritten: dq from every block this rank's queries took part in, dk/dv from
// every rank's queries against this rank's keys (accumulators that travel the ring with K/V and
// come home after cp hops; with allgather, one reduce-scatter).
void ring_attention_backward(const StepContext& ctx, const CpOptions& cp, const RingDims& g,
                             const float* qkv, const float* out, const float* lse,
                             const float* dout, float* dqkv) {
  dist::ProcessGroup& grp = *cp.group;
  const int n = cp.size(), r = cp.rank();
  const int64_t M = ctx.B * ctx.T, kvw = 2 * g.Hkv * g.hd, Hq = g.Hq, hd = g.hd;
  const cpu::BlockShape bs = g.block(ctx);
  Tensor delta = f32({ctx.B * Hq * ctx.T}, Device::cpu);
  cpu::attention_delta(ctx.B, ctx.T, Hq, hd, out, dout, delta.data<float>());
  std::fill_n(dqkv, M * g.nqkv, 0.0f);
  auto consume = [&](const float* kv, float* dkv, int src,
                     const std::function<void()>& progress = {}) {
    if (!block_has_work(ctx, r, src)) return;
    cpu::attention_block_backward(bs, qkv, kv, kv + g.Hkv * hd, ctx.cp_pos[r].data(),
                                  ctx.cp_pos[src].data(), lse, delta.data<float>(), dout, dqkv, dkv,
                                  dkv + g.Hkv * hd, progress);
  };
  Tensor own = f32({M, kvw}, Device::cpu);
  if (cp.allgather) {
    Tensor all = f32({n, M, kvw}, Device::cpu);
    Tensor dall = Tensor::zeros({n, M, kvw}, DType::f32, Device::cpu);
    pack_kv(qkv, M, g.nqkv, Hq * hd, kvw, all[r].data<float>());
    grp.all_gather(all[r], all)->wait();
    for (int s = 0; s < n; ++s) consume(all[s].data<float>(), dall[s].data<float>(), s);
    grp.reduce_scatter(dall, own, dist::ReduceOp::sum)->wait();
  } else {
    // dK/dV accumulators travel with their K/V block: the one for block (r - i) arrives from the
    // previous rank while this rank computes block (r - i)'s contribution into `part`, so the hop
    // overlaps compute; the sum is sent on at once. After n hops each rank holds its own keys'.
    Tensor cur = f32({M, kvw}, Device::cpu), nxt = f32({M, kvw}, Device::cpu);
    Tensor part = f32({M, kvw}, Device::cpu), in = f32({M, kvw}, Device::cpu);
    Tensor out_acc = f32({M, kvw}, Device::cpu);
    pack_kv(qkv, M, g.nqkv, Hq * hd, kvw, cur.data<float>());
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::unique_ptr<dist::Work> acc_send, acc_recv;
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<dist::Work> sw, rw;
      if (i + 1 < n) {
        sw = grp.send(cur, next, 2 * i);
        rw = grp.recv(nxt, prev, 2 * i);
      }
      part.zero_();
      consume(cur.data<float>(), part.data<float>(), (r + n - i) % n,
              in_flight({sw.get(), rw.get(), acc_send.get(), acc_recv.get()}));
      if (acc_send) acc_send->wait();
      if (i == 0) {
        std::swap(part, out_acc);
      } else {
        acc_recv->wait();
        float* a = in.data<float>();
        const float* p = part.data<float>();
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < M * kvw; ++e) a[e] += p[e];
        std::swap(in, out_acc);
      }
      acc_send = grp.send(out_acc, next, 2 * i + 1);
      acc_recv = grp.recv(in, prev, 2 * i + 1);
      if (sw) {
        sw->wait();
        rw->wait();
        std::swap(cur, nxt);
      }
    }
    acc_send->wait();
    acc_recv->wait();
    own = in;
  }
  unpack_kv(own.data<float>(), M, g.nqkv, Hq * hd, kvw, dqkv);
}

}  // namespace

int CpOptions::size() const {
  return group ? group->size() : 1;
}
int CpOptions::rank() const {
  return group ? group->rank() : 0;
}

int TpOptions::size() const {
  return group ? group->size() : 1;
}
int TpOptions::rank() const {
  return group ? group->rank() : 0;
}

ActivationCheckpoint ActivationCheckpoint::parse(const std::string& mode,
                                                 const std::string& selective_option) {
  ActivationCheckpoint ac;
  if (mode == "none") return ac;
  if (mode == "full") {
    ac.mode = Mode::full;
    return ac;
  }
  LOOM_CHECK(mode == "selective", "activation_checkpoint.mode = \"", mode,
             "\": expected \"none\", \"full\" or \"selective\"");
  if (selective_option == "op") {
    ac.mode = Mode::op;
    return ac;
  }
  int n = 0;
  const char* end = selective_option.data() + selective_option.size();
  auto r = std::from_chars(selective_option.data(), end, n);
  LOOM_CHECK(!selective_option.empty() && r.ec == std::errc() && r.ptr == end && n >= 1,
             "activation_checkpoint.selective_option = \"", selective_option,
             "\": expected \"op\" or a positive integer N");
  ac.mode = Mode::full;
  ac.every_n = n;
  return ac;
}

ActivationCheckpoint::Mode ActivationCheckpoint::block_mode(int64_t layer) const {
  if (mode == Mode::full && layer % every_n != 0) return Mode::none;
  return mode;
}

size_t BlockActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&x, &rstd1, &xn1, &qkv, &attn, &lse, &h, &rstd2, &xn2, &gu, &act})
    if (t->defined()) n += t->nbytes();
  return n;
}

static std::vector<ParamSpec> block_specs(const LlamaConfig& c, int64_t layer, int tp_rank,
                                          int tp) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t d = c.hidden_size, hd = c.head_dim(), F = c.intermediate_size / tp;
  const int64_t q = c.num_attention_heads / tp * hd, kv = c.num_key_value_heads / tp * hd;
  // Output projections of the residual branches start smaller (GPT-2 / Megatron scaled init), so
  // the residual stream's variance does not grow with depth.
  const float out_std = 0.02f / std::sqrt(2.0f * float(c.num_hidden_layers));
  const auto R = TpSplit::rows, C = TpSplit::cols, N = TpSplit::none;
  std::vector<ParamSpec> specs{
      {p + "input_layernorm.weight", {d}, Init::ones, 0, false, true, N},
      {p + "self_attn.q_proj.weight", {q, d}, Init::normal, 0.02f, true, false, R},
      {p + "self_attn.k_proj.weight", {kv, d}, Init::normal, 0.02f, true, false, R},
      {p + "self_attn.v_proj.weight", {kv, d}, Init::normal, 0.02f, true, false, R},
      {p + "self_attn.o_proj.weight", {d, q}, Init::normal, out_std, true, false, C},
      {p + "post_attention_layernorm.weight", {d}, Init::ones, 0, false, true, N},
      {p + "mlp.gate_proj.weight", {F, d}, Init::normal, 0.02f, true, false, R},
      {p + "mlp.up_proj.weight", {F, d}, Init::normal, 0.02f, true, false, R},
      {p + "mlp.down_proj.weight", {d, F}, Init::normal, out_std, true, false, C},
  };
  for (auto& sp : specs) {
    sp.tp_rank = tp_rank;
    sp.tp_count = tp;
  }
  return specs;
}

TransformerBlock::TransformerBlock(const LlamaConfig& c, int64_t layer, bool bf16, Device device,
                                   ShardLayout shard, const TpRuntime* tp)
    : c_(c),
      tp_(tp),
      unit_("layers." + std::to_string(layer),
            block_specs(c, layer, tp ? tp->opt.rank() : 0, tp ? tp->opt.size() : 1), bf16, device,
            shard) {}

Tensor TransformerBlock::forward(const StepContext& ctx, const Tensor& x, BlockActs& a) const {
  Tensor out = run_forward(ctx, x, a, ac_, true);
  if (ac_ == ActivationCheckpoint::Mode::full) {
    // Only the input stays; backward recomputes the rest from it.
    Tensor input = a.x;
    a = BlockActs();
    a.x = input;
  }
  return out;
}

Tensor TransformerBlock::run_forward(const StepContext& ctx, const Tensor& x, BlockActs& a,
                                     ActivationCheckpoint::Mode mode, bool output) const {
  const TpRuntime none;
  const TpRuntime& tp = tp_ ? *tp_ : none;
  const int tpn = tp.on() ? tp.opt.size() : 1;
  const int64_t M = ctx.tokens(), d = c_.hidden_size, hd = c_.head_dim();
  const int64_t Hq = c_.num_attention_heads / tpn, Hkv = c_.num_key_value_heads / tpn;
  const int64_t F = c_.intermediate_size / tpn, nqkv = (Hq + 2 * Hkv) * hd;
  const int64_t Mx = tp.sp() ? M / tpn : M;  // rows of the block's input and output
  const auto& P = unit_.params();
  const Device dev = x.device();
  const DType dt = ctx.compute;
  const float eps = float(c_.rms_norm_eps);
  const bool run = live(x);
  // `op` drops the norm and SwiGLU outputs after their GEMM; backward recomputes them (and,
  // with SP, gathers the norm outputs again, as with recompute_allgather). Neither `op` nor
  // `full` keeps a gathered GEMM input: it goes to the pooled buffer.
  const bool op = mode == ActivationCheckpoint::Mode::op;

  // A column-parallel GEMM, y [M, N] = input w^T, whose input is `local` (this rank's rows with
  // SP): with SP the input of every row is gathered, and kept for backward in `saved` (a new
  // tensor), or, when backward gathers again, only in a pooled buffer. Async: the gather runs
  // while the local rows' GEMM is computed in chunks, MPI driven (Work::test) between chunks.
  auto column_parallel = [&](const Tensor& local, Tensor& saved, size_t w, Tensor& y, int64_t N) {
    if (!tp.sp()) {
      saved = local;
      linear(local, unit_.gemm_weights(w), y, N, d, dt, false);
      return;
    }
    Tensor full;
    if (tp.opt.recompute_allgather || mode != ActivationCheckpoint::Mode::none) {
      saved = local;
      full = pooled(tp, "ag_input", {M, d}, dt, dev);
    } else {
      saved = full = Tensor::empty({M, d}, dt, dev);
    }
    if (!tp.opt.async || !run) {
      tp_gather_rows(tp, local, full);
      linear(full, unit_.gemm_weights(w), y, N, d, dt, false);
      return;
    }
    auto work = tp.opt.group->all_gather(local.view({local.numel()}), full.view({full.numel()}));
    const int64_t r0 = int64_t(tp.opt.rank()) * Mx, chunks = 4;
    const int64_t step = (Mx + chunks - 1) / chunks;
    for (int64_t i = 0; i < Mx; i += step) {
      const int64_t n = std::min(step, Mx - i);
      Tensor out = y.narrow(0, r0 + i, n);
      linear(local.narrow(0, i, n), unit_.gemm_weights(w), out, N, d, dt, false);
      work->test();
    }
    work->wait();
    if (r0 > 0) {
      Tensor out = y.narrow(0, 0, r0);
      linear(full.narrow(0, 0, r0), unit_.gemm_weights(w), out, N, d, dt, false);
    }
    if (r0 + Mx < M) {
      Tensor out = y.narrow(0, r0 + Mx, M - r0 - Mx);
      linear(full.narrow(0, r0 + Mx, M - r0 - Mx), unit_.gemm_weights(w), out, N, d, dt, false);
    }
  };
  // residual + the row-parallel GEMM's output summed over tp (this rank's rows with SP).
  auto row_parallel = [&](const Tensor& in, int64_t K, size_t w, const Tensor& residual) {
    Tensor out = f32({Mx, d}, dev);
    out.copy_from(residual);
    if (!tp.on()) {
      linear(in, unit_.gemm_weights(w), out, d, K, dt, true);
      return out;
    }
    Tensor part = pooled(tp, "row_out", {M, d}, DType::f32, dev);
    linear(in, unit_.gemm_weights(w), part, d, K, dt, false);
    Tensor sum = part;
    if (tp.sp()) {
      sum = pooled(tp, "row_out_rs", {Mx, d}, DType::f32, dev);
      tp_reduce_scatter_rows(tp, part, sum);
    } else {
      tp_all_reduce(tp, part);
    }
    if (run) {
      float* o = out.data<float>();
      const float* s = sum.data<float>();
#pragma omp parallel for
      for (int64_t i = 0; i < Mx * d; ++i) o[i] += s[i];
    }
    return out;
  };

  a.x = x;
  a.rstd1 = f32({Mx}, dev);
  {
    Tensor xn1 = f32({Mx, d}, dev);
    if (run)
      cpu::rmsnorm_forward(x.data<float>(), P[kNorm1].value.data<float>(), Mx, d, eps,
                           xn1.data<float>(), a.rstd1.data<float>());
    a.qkv = f32({M, nqkv}, dev);
    column_parallel(to_compute(xn1, dt), a.xn1, kQ, a.qkv, nqkv);
    if (op) a.xn1 = Tensor();
  }
  a.attn = f32({M, Hq * hd}, dev);
  a.lse = f32({ctx.B, Hq, ctx.T}, dev);
  if (run) {
    float* q = a.qkv.data<float>();
    cpu::rope_forward(q, ctx.B, ctx.T, Hq, hd, nqkv, ctx.positions.data(), *ctx.rope);
    cpu::rope_forward(q + Hq * hd, ctx.B, ctx.T, Hkv, hd, nqkv, ctx.positions.data(), *ctx.rope);
    if (tp_ && tp_->cp.size() > 1) {
      ring_attention_forward(ctx, tp_->cp, {Hq, Hkv, hd, nqkv}, q, a.attn.data<float>(),
                             a.lse.data<float>());
    } else {
      cpu::AttentionShape s{ctx.B, ctx.T, Hq, Hkv, hd, nqkv, nqkv, 1.0f / std::sqrt(float(hd))};
      cpu::attention_forward(s, q, q + Hq * hd, q + (Hq + Hkv) * hd, a.attn.data<float>(),
                             a.lse.data<float>());
    }
  }
  a.h = row_parallel(to_compute(a.attn, dt), Hq * hd, kO, x);

  a.rstd2 = f32({Mx}, dev);
  {
    Tensor xn2 = f32({Mx, d}, dev);
    if (run)
      cpu::rmsnorm_forward(a.h.data<float>(), P[kNorm2].value.data<float>(), Mx, d, eps,
                           xn2.data<float>(), a.rstd2.data<float>());
    a.gu = f32({M, 2 * F}, dev);
    column_parallel(to_compute(xn2, dt), a.xn2, kGate, a.gu, 2 * F);
    if (op) a.xn2 = Tensor();
  }
  {
    Tensor act = f32({M, F}, dev);
    if (run) cpu::swiglu_forward(a.gu.data<float>(), M, F, act.data<float>());
    a.act = to_compute(act, dt);
  }
  if (!output) return Tensor();
  Tensor out = row_parallel(a.act, F, kDown, a.h);
  if (op) a.act = Tensor();
  return out;
}

void TransformerBlock::backward(const StepContext& ctx, Tensor& dy, BlockActs& a) {
  const TpRuntime none;
  const TpRuntime& tp = tp_ ? *tp_ : none;
  const int tpn = tp.on() ? tp.opt.size() : 1;
  const int64_t M = ctx.tokens(), d = c_.hidden_size, hd = c_.head_dim();
  const int64_t Hq = c_.num_attention_heads / tpn, Hkv = c_.num_key_value_heads / tpn;
  const int64_t F = c_.intermediate_size / tpn, nqkv = (Hq + 2 * Hkv) * hd;
  const int64_t Mx = tp.sp() ? M / tpn : M;
  auto& P = unit_.params();
  const Device dev = dy.device();
  const DType dt = ctx.compute;
  const bool run = live(dy);
  const float eps = float(c_.rms_norm_eps);
  // `full` saved the input only: the forward runs again (tp and cp communication included),
  // after the unit's before_backward hook, so FSDP has gathered the weights it reads.
  if (!a.h.defined()) {
    const Tensor x = a.x;
    run_forward(ctx, x, a, ActivationCheckpoint::Mode::none, false);
  }

  // The gradient w.r.t. a row-parallel GEMM's output, for every row (the backward of the
  // reduce-scatter is an all-gather).
  auto full_dy = [&]() -> Tensor {
    if (!tp.sp()) return to_compute(dy, dt);
    Tensor g = pooled(tp, "ag_dy", {M, d}, DType::f32, dev);
    tp_gather_rows(tp, dy, g);
    return to_compute(g, dt);
  };
  auto gather_input = [&](const Tensor& local) -> Tensor {
    Tensor full = pooled(tp, "ag_input", {M, d}, dt, dev);
    tp_gather_rows(tp, local, full);
    return full;
  };
  // The input of a column-parallel GEMM, every row: the norm output `saved`, or, when `op`
  // dropped it, recomputed from the norm's input (the same kernel on the same input: the same
  // bits) and, with SP, gathered again.
  auto norm_output = [&](const Tensor& saved, const Tensor& in, size_t w) -> Tensor {
    if (saved.defined()) return tp.sp() && tp.opt.recompute_allgather ? gather_input(saved) : saved;
    Tensor xn = f32({Mx, d}, dev), rstd = f32({Mx}, dev);
    if (run)
      cpu::rmsnorm_forward(in.data<float>(), P[w].value.data<float>(), Mx, d, eps, xn.data<float>(),
                           rstd.data<float>());
    return tp.sp() ? gather_input(to_compute(xn, dt)) : to_compute(xn, dt);
  };
  // dx = dy w of a column-parallel GEMM, summed over tp (this rank's rows with SP).
  auto column_dx = [&](const Tensor& dout, const Tensor& in, size_t w, int64_t N) -> Tensor {
    if (!tp.on()) {
      Tensor dx = f32({M, d}, dev);
      linear_backward(dout, in, unit_.gemm_weights(w), unit_.grad_data(w), &dx, N, d, dt);
      return dx;
    }
    Tensor part = pooled(tp, "col_dx", {M, d}, DType::f32, dev);
    linear_backward(dout, in, unit_.gemm_weights(w), unit_.grad_data(w), &part, N, d, dt);
    if (!tp.sp()) {
      tp_all_reduce(tp, part);
      return part;
    }
    Tensor dx = pooled(tp, "col_dx_rs", {Mx, d}, DType::f32, dev);
    tp_reduce_scatter_rows(tp, part, dx);
    return dx;
  };

  // MLP branch: out = h + down(swiglu(gate_up(norm2(h)))).
  {
    Tensor dgu = a.gu;
    a.gu = Tensor();
    {
      Tensor dact = f32({M, F}, dev);
      if (!a.act.defined()) {
        // `op`: silu(gate) * up again, before the SwiGLU backward overwrites gu; in bf16 dact
        // holds the f32 result until it is rounded.
        Tensor act = dt == DType::f32 ? f32({M, F}, dev) : dact;
        if (run) cpu::swiglu_forward(dgu.data<float>(), M, F, act.data<float>());
        a.act = to_compute(act, dt);
      }
      linear_backward(full_dy(), a.act, unit_.gemm_weights(kDown), unit_.grad_data(kDown), &dact, d,
                      F, dt);
      a.act = Tensor();
      if (run) cpu::swiglu_backward(dact.data<float>(), dgu.data<float>(), M, F, dgu.data<float>());
    }
    Tensor dxn2 = column_dx(to_compute(dgu, dt), norm_output(a.xn2, a.h, kNorm2), kGate, 2 * F);
    dgu = Tensor();
    a.xn2 = Tensor();
    tp_summed_norm_grad(tp, unit_.grad_data(kNorm2), d, dev, [&](float* g) {
      if (run)
        cpu::rmsnorm_backward(dxn2.data<float>(), a.h.data<float>(), P[kNorm2].value.data<float>(),
                              a.rstd2.data<float>(), Mx, d, dy.data<float>(), g);
    });
    a.h = a.rstd2 = Tensor();
  }
  // Attention branch: h = x + o(attention(rope(qkv(norm1(x))))).
  {
    Tensor dqkv = f32({M, nqkv}, dev);
    {
      Tensor dattn = f32({M, Hq * hd}, dev);
      linear_backward(full_dy(), to_compute(a.attn, dt), unit_.gemm_weights(kO),
                      unit_.grad_data(kO), &dattn, d, Hq * hd, dt);
      if (run) {
        const float* q = a.qkv.data<float>();
        float* dq = dqkv.data<float>();
        if (tp_ && tp_->cp.size() > 1) {
          ring_attention_backward(ctx, tp_->cp, {Hq, Hkv, hd, nqkv}, q, a.attn.data<float>(),
                                  a.lse.data<float>(), dattn.data<float>(), dq);
        } else {
          cpu::AttentionShape s{ctx.B, ctx.T, Hq, Hkv, hd, nqkv, nqkv, 1.0f / std::sqrt(float(hd))};
          cpu::attention_backward(s, q, q + Hq * hd, q + (Hq + Hkv) * hd, a.attn.data<float>(),
                                  a.lse.data<float>(), dattn.data<float>(), dq, dq + Hq * hd,
                                  dq + (Hq + Hkv) * hd);
        }
        cpu::rope_backward(dq, ctx.B, ctx.T, Hq, hd, nqkv, ctx.positions.data(), *ctx.rope);
        cpu::rope_backward(dq + Hq * hd, ctx.B, ctx.T, Hkv, hd, nqkv, ctx.positions.data(),
                           *ctx.rope);
      }
      a.attn = a.lse = a.qkv = Tensor();
    }
    Tensor dxn1 = column_dx(to_compute(dqkv, dt), norm_output(a.xn1, a.x, kNorm1), kQ, nqkv);
    dqkv = Tensor();
    a.xn1 = Tensor();
    tp_summed_norm_grad(tp, unit_.grad_data(kNorm1), d, dev, [&](float* g) {
      if (run)
        cpu::rmsnorm_backward(dxn1.data<float>(), a.x.data<float>(), P[kNorm1].value.data<float>(),
                              a.rstd1.data<float>(), Mx, d, dy.data<float>(), g);
    });
  }
  a = BlockActs();
}

LlamaModel::LlamaModel(const LlamaConfig& config, DType compute, Device device, ShardLayout shard,
                       TpOptions tp, CpOptions cp)
    : config_(config), compute_(compute), device_(device), shard_(shard) {
  config_.validate("model config");
  LOOM_CHECK(compute == DType::f32 || compute == DType::bf16,
             "compute dtype must be float32 or bfloat16, got ", dtype_name(compute));
  const int n = tp.size(), r = tp.rank();
  if (n > 1) {
    // Refused rather than replicating kv heads (docs/design.md, "Tensor parallelism").
    for (auto [what, v] :
         {std::pair<const char*, int64_t>{"num_attention_heads", config_.num_attention_heads},
          {"num_key_value_heads", config_.num_key_value_heads},
          {"intermediate_size", config_.intermediate_size}})
      LOOM_CHECK(
          v % n == 0, "tensor parallelism: model ", what, " = ", v,
          " is not divisible by parallelism.tp = ", n, " (every tp rank holds ", what, " / tp",
          std::string(what) == "num_key_value_heads" ? "; kv heads are not replicated" : "", ")");
  } else {
    tp.group = nullptr;
  }
  tp_ = std::make_unique<TpRuntime>();
  tp_->opt = tp;
  if (cp.size() <= 1) cp.group = nullptr;
  tp_->cp = cp;
  tp_->pool = &pool_;
  const bool bf = compute == DType::bf16;
  // A vocabulary that tp does not divide is padded to the next multiple of tp (Megatron's
  // make-vocab-size-divisible-by): the padding rows are zero, their logits are masked out of the
  // loss, and checkpoints hold the real rows only (ParamSpec::global_rows).
  const int64_t d = config_.hidden_size, V = local_vocab(n);
  const int64_t real_rows = V * n == config_.vocab_size ? 0 : config_.vocab_size;
  ParamSpec emb{"model.embed_tokens.weight",
                {V, d},
                Init::normal,
                0.02f,
                true,
                true,
                TpSplit::rows,
                r,
                n,
                real_rows};
  embed_ = std::make_unique<ParamUnit>("embed", std::vector<ParamSpec>{emb}, bf, device, shard);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    blocks_.push_back(std::make_unique<TransformerBlock>(config_, l, bf, device, shard, tp_.get()));
  std::vector<ParamSpec> head{{"model.norm.weight", {d}, Init::ones, 0, false, true}};
  if (!config_.tie_word_embeddings)
    head.push_back({"lm_head.weight",
                    {V, d},
                    Init::normal,
                    0.02f,
                    true,
                    false,
                    TpSplit::rows,
                    r,
                    n,
                    real_rows});
  head_ = std::make_unique<ParamUnit>("head", head, bf, device, shard);
}

std::vector<ParamUnit*> LlamaModel::units() {
  std::vector<ParamUnit*> u{embed_.get()};
  for (auto& b : blocks_) u.push_back(&b->unit());
  u.push_back(head_.get());
  return u;
}

int64_t LlamaModel::num_params() const {
  int64_t n = embed_->numel() + head_->numel();
  for (auto& b : blocks_) n += b->unit().numel();
  return n;
}

void LlamaModel::init_weights(uint64_t seed) {
  for (ParamUnit* u : units()) u->init_weights(seed);
}

void LlamaModel::load_hf(const SafetensorsDir& dir) {
  for (ParamUnit* u : units()) {
    if (!u->sharded()) {
      for (auto& p : u->params()) {
        if (p.spec.split == TpSplit::none || p.spec.tp_count == 1)
          dir.read_f32(p.spec.name, p.spec.shape, p.value.data<float>());
        else
          read_param_slice(dir, p.spec.name, p.spec, 0, shape_numel(p.spec.shape),
                           p.value.data<float>());
      }
      u->refresh_bf16();
      continue;
    }
    float* shard = u->master_shard().data<float>();
    for (const ShardSlice& s : u->shard_slices()) {
      const ParamSpec& spec = u->params()[s.param].spec;
      read_param_slice(dir, spec.name, spec, s.begin, s.count, shard + s.shard_offset);
    }
  }
}

void LlamaModel::zero_grad() {
  for (ParamUnit* u : units()) u->zero_grad();
}

void LlamaModel::set_activation_checkpoint(const ActivationCheckpoint& ac) {
  LOOM_CHECK(ac.every_n >= 1, "activation checkpointing: every_n = ", ac.every_n,
             ", expected a positive integer");
  ac_ = ac;
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l]->set_checkpoint(ac.block_mode(int64_t(l)));
}

const cpu::RopeTable& LlamaModel::rope_for(int64_t T) {
  if (rope_.num_positions < T)
    rope_ = cpu::rope_table(config_.head_dim(), T, config_.rope_theta, config_.rope_scaling);
  return rope_;
}

double LlamaModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                    int64_t T, float grad_scale) {
  const TpRuntime& tp = *tp_;
  const int tpn = tp.opt.size();
  const int64_t M = B * T, d = config_.hidden_size, V = local_vocab(tpn);
  const int64_t v0 = int64_t(tp.opt.rank()) * V;  // first vocabulary row of this tp rank
  LOOM_CHECK(
      !tp.sp() || M % tpn == 0, "sequence parallelism: the micro-batch's B*T = ", B, "*", T, " = ",
      M, " rows are not divisible by parallelism.tp = ", tpn,
      " (each tp rank holds B*T / tp rows; or set parallelism.tp_sequence_parallel = false)");
  const int64_t Mx = tp.sp() ? M / tpn : M;  // rows of the residual stream on this rank
  const bool run = device_ != Device::meta;
  StepContext ctx;
  ctx.B = B;
  ctx.T = T;
  ctx.compute = compute_;
  ctx.positions.resize(T);
  if (tp.cp.size() > 1) {
    const int n = tp.cp.size();
    for (int s = 0; s < n; ++s)
      ctx.cp_pos.push_back(cpu::cp_positions(T * n, n, s, tp.sp() ? tpn : 1));
    for (int64_t t = 0; t < T; ++t) ctx.positions[t] = int32_t(ctx.cp_pos[tp.cp.rank()][t]);
    ctx.rope = &rope_for(T * n);
  } else {
    for (int64_t t = 0; t < T; ++t) ctx.positions[t] = int32_t(t);
    ctx.rope = &rope_for(T);
  }

  LOOM_CHECK(hooks_ || !shard_.sharded(),
             "forward_backward: a sharded model needs hooks that materialize its units");
  const size_t head_unit = blocks_.size() + 1;
  auto hook = [this](void (UnitHooks::*fn)(size_t), size_t unit) {
    if (hooks_) (hooks_->*fn)(unit);
  };

  Tensor x = f32({Mx, d}, device_);
  hook(&UnitHooks::before_forward, 0);
  if (!tp.on()) {
    if (run)
      cpu::embedding_forward(inputs, M, embed_->params()[0].value.data<float>(), V, d,
                             x.data<float>());
  } else {
    // Vocabulary-parallel: rows of other ranks' tokens are zero here; the sum over tp is the
    // embedding (this rank's rows of it with sequence parallelism).
    Tensor part = pooled(tp, "row_out", {M, d}, DType::f32, device_);
    if (run) {
      const float* table = embed_->params()[0].value.data<float>();
      float* o = part.data<float>();
#pragma omp parallel for
      for (int64_t m = 0; m < M; ++m) {
        const int64_t t = int64_t(inputs[m]) - v0;
        if (t >= 0 && t < V)
          std::copy_n(table + t * d, d, o + m * d);
        else
          std::fill_n(o + m * d, d, 0.0f);
      }
    }
    if (tp.sp()) {
      tp_reduce_scatter_rows(tp, part, x);
    } else {
      tp_all_reduce(tp, part);
      x.copy_from(part);
    }
  }
  hook(&UnitHooks::after_forward, 0);

  std::vector<BlockActs> acts(blocks_.size());
  for (size_t l = 0; l < blocks_.size(); ++l) {
    hook(&UnitHooks::before_forward, l + 1);
    x = blocks_[l]->forward(ctx, x, acts[l]);
    hook(&UnitHooks::after_forward, l + 1);
  }

  // Head: final norm, then the output projection fused with the loss (forward and backward).
  Tensor dx;
  double loss = 0;
  hook(&UnitHooks::before_forward, head_unit);
  hook(&UnitHooks::after_forward, head_unit);
  hook(&UnitHooks::before_backward, head_unit);
  {
    const Param& norm = head_->params()[0];
    Tensor rstd = f32({Mx}, device_), xf = f32({Mx, d}, device_);
    if (run)
      cpu::rmsnorm_forward(x.data<float>(), norm.value.data<float>(), Mx, d,
                           float(config_.rms_norm_eps), xf.data<float>(), rstd.data<float>());
    Tensor xf_c = to_compute(xf, compute_);
    xf = Tensor();
    if (tp.sp()) {
      Tensor full = pooled(tp, "ag_input", {M, d}, compute_, device_);
      tp_gather_rows(tp, xf_c, full);
      xf_c = full;
    }
    ParamUnit& out_unit = config_.tie_word_embeddings ? *embed_ : *head_;
    const size_t out_index = config_.tie_word_embeddings ? 0 : 1;
    Tensor dxf = tp.on() ? pooled(tp, "col_dx", {M, d}, DType::f32, device_) : f32({M, d}, device_);
    if (run) {
      cpu::LinearCrossEntropyArgs ce;
      ce.x = xf_c.raw();
      ce.w = out_unit.gemm_weights(out_index);
      ce.ab = compute_;
      ce.targets = targets;
      ce.N = M;
      ce.D = d;
      ce.V = V;
      ce.grad_scale = grad_scale;
      ce.dx = dxf.data<float>();
      ce.dw = out_unit.grad_data(out_index);
      ce.chunk_rows = loss_chunk_rows(config_, B, T, compute_);
      loss = tp.on() ? vocab_parallel_cross_entropy(ce, v0) : cpu::linear_cross_entropy(ce);
    }
    xf_c = Tensor();
    if (tp.sp()) {
      Tensor mine = pooled(tp, "col_dx_rs", {Mx, d}, DType::f32, device_);
      tp_reduce_scatter_rows(tp, dxf, mine);
      dxf = mine;
    } else if (tp.on()) {
      tp_all_reduce(tp, dxf);
    }
    dx = Tensor::zeros({Mx, d}, DType::f32, device_);
    tp_summed_norm_grad(tp, head_->grad_data(0), d, device_, [&](float* g) {
      if (run)
        cpu::rmsnorm_backward(dxf.data<float>(), x.data<float>(), norm.value.data<float>(),
                              rstd.data<float>(), Mx, d, dx.data<float>(), g);
    });
  }
  hook(&UnitHooks::after_backward, head_unit);
  x = Tensor();
  for (size_t l = blocks_.size(); l-- > 0;) {
    hook(&UnitHooks::before_backward, l + 1);
    blocks_[l]->backward(ctx, dx, acts[l]);
    hook(&UnitHooks::after_backward, l + 1);
  }
  hook(&UnitHooks::before_backward, 0);
  if (!tp.on()) {
    if (run) cpu::embedding_backward(inputs, M, dx.data<float>(), V, d, embed_->grad_data(0));
  } else {
    Tensor full = dx;
    if (tp.sp()) {
      full = pooled(tp, "ag_dy", {M, d}, DType::f32, device_);
      tp_gather_rows(tp, dx, full);
    }
    if (run) {
      // Rows of this rank's vocabulary only; serial in token order (a token may repeat).
      float* g = embed_->grad_data(0);
      const float* s = full.data<float>();
      for (int64_t m = 0; m < M; ++m) {
        const int64_t t = int64_t(inputs[m]) - v0;
        if (t < 0 || t >= V) continue;
        float* gr = g + t * d;
        const float* sr = s + m * d;
        for (int64_t i = 0; i < d; ++i) gr[i] += sr[i];
      }
    }
  }
  hook(&UnitHooks::after_backward, 0);
  return loss;
}

double LlamaModel::vocab_parallel_cross_entropy(const cpu::LinearCrossEntropyArgs& a, int64_t v0) {
  // Loss parallel: this rank's logits [rows, V/tp] per chunk; the row's log-sum-exp combines
  // the ranks' local ones (an all-gather of [tp, N]), the target logit comes from the rank that
  // owns it (an all-reduce sum of the masked target logit). dx is this rank's part (the caller
  // sums it over tp); dW is this rank's rows, exactly.
  const TpRuntime& tp = *tp_;
  const int n = tp.opt.size();
  const int64_t N = a.N, D = a.D, V = a.V;
  const int64_t rows = std::max<int64_t>(1, std::min(a.chunk_rows > 0 ? a.chunk_rows : 64, N));
  const size_t es = dtype_size(a.ab);
  const char* xb = static_cast<const char*>(a.x);
  Tensor lse_all = pooled(tp, "ce_lse_all", {int64_t(n), N}, DType::f32, Device::cpu);
  Tensor lse = lse_all.narrow(0, tp.opt.rank(), 1).view({N});
  Tensor tgt = pooled(tp, "ce_target", {N}, DType::f32, Device::cpu);
  // The logits chunk is the loss's workspace (sized by the memory budget of loss_chunk_rows),
  // not a communication buffer: allocated here, as the single-process loss does.
  Tensor logits = Tensor::empty({rows, V}, DType::f32);
  // Columns past the real vocabulary are padding (a vocabulary tp does not divide): never
  // predicted, so left out of the softmax and given no gradient.
  const int64_t Vr = std::clamp<int64_t>(config_.vocab_size - v0, 0, V);
  for (int64_t i = 0; i < N; ++i)
    LOOM_CHECK(a.targets[i] < config_.vocab_size, "cross-entropy: target ", a.targets[i],
               " of row ", i, " is outside the vocabulary of ", config_.vocab_size);
  float* L = logits.data<float>();
  float* ls = lse.data<float>();
  float* tg = tgt.data<float>();
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    cpu::linear_forward(xb + size_t(r0 * D) * es, a.w, L, nr, V, D, a.ab, false);
#pragma omp parallel for
    for (int64_t i = 0; i < nr; ++i) {
      const float* l = L + i * V;
      float mx = -INFINITY;
      for (int64_t v = 0; v < Vr; ++v) mx = std::max(mx, l[v]);
      double s = 0;
      for (int64_t v = 0; v < Vr; ++v) s += std::exp(double(l[v] - mx));
      // A rank holding padding only adds nothing to the log-sum-exp (exp(-inf) = 0).
      ls[r0 + i] = Vr > 0 ? float(double(mx) + std::log(s)) : -INFINITY;
      const int64_t t = int64_t(a.targets[r0 + i]);
      tg[r0 + i] = (t >= v0 && t < v0 + V) ? l[t - v0] : 0.0f;
    }
  }
  // In place: this rank's row of lse_all is its input block.
  tp.opt.group->all_gather(lse, lse_all.view({int64_t(n) * N}))->wait();
  tp_all_reduce(tp, tgt);
  const float* la = lse_all.data<float>();
  double loss = 0;
  std::vector<float> glse(size_t(N), 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    float mx = -INFINITY;
    for (int r = 0; r < n; ++r) mx = std::max(mx, la[r * N + i]);
    double s = 0;
    for (int r = 0; r < n; ++r) s += std::exp(double(la[r * N + i] - mx));
    glse[size_t(i)] = float(double(mx) + std::log(s));
    if (a.targets[i] >= 0) loss += double(glse[size_t(i)]) - double(tg[i]);
  }
  Tensor dl_c =
      a.ab == DType::f32 ? logits : pooled(tp, "ce_dlogits", {rows, V}, DType::bf16, Device::cpu);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    cpu::linear_forward(xb + size_t(r0 * D) * es, a.w, L, nr, V, D, a.ab, false);
#pragma omp parallel for
    for (int64_t i = 0; i < nr; ++i) {
      float* l = L + i * V;
      const int64_t t = int64_t(a.targets[r0 + i]);
      if (t < 0) {
        std::fill_n(l, V, 0.0f);
        continue;
      }
      const float g = glse[size_t(r0 + i)];
      for (int64_t v = 0; v < Vr; ++v) l[v] = std::exp(l[v] - g) * a.grad_scale;
      std::fill(l + Vr, l + V, 0.0f);
      if (t >= v0 && t < v0 + V) l[t - v0] -= a.grad_scale;
    }
    if (a.ab == DType::bf16) cpu::cast_f32_to_bf16(L, dl_c.data<bf16>(), nr * V);
    if (a.dx) cpu::linear_backward_input(dl_c.raw(), a.w, a.dx + r0 * D, nr, V, D, a.ab, false);
    if (a.dw)
      cpu::linear_backward_weight(dl_c.raw(), xb + size_t(r0 * D) * es, a.dw, nr, V, D, a.ab);
  }
  return loss;
}

int64_t LlamaModel::loss_chunk_rows(const LlamaConfig& c, int64_t B, int64_t T, DType compute) {
  // The fused loss's workspace (f32 logits, plus their bf16 gradient in bf16 mode) is held to 2%
  // of the step's saved activations, so the peak stays what the memory model predicts; larger
  // chunks are a few percent faster (fewer passes over dW) but would be memory nobody planned for.
  const double per_row = double(c.vocab_size) * (4 + (compute == DType::bf16 ? 2 : 0));
  const auto budget = 0.02 * double(saved_activation_bytes(c, B, T, compute));  // tp: same rows
  const int64_t rows = int64_t(budget / per_row) / 16 * 16;
  return std::clamp<int64_t>(rows, std::min<int64_t>(64, B * T), B * T);
}

size_t LlamaModel::saved_activation_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                          int tp, bool sp, bool recompute,
                                          const ActivationCheckpoint& ac) {
  const size_t n = size_t(tp), M = size_t(B * T), d = c.hidden_size, hd = c.head_dim();
  const size_t Hq = c.num_attention_heads / n, Hkv = c.num_key_value_heads / n;
  const size_t F = c.intermediate_size / n;
  const size_t Mx = tp > 1 && sp ? M / n : M;             // rows of the residual stream
  const size_t Mn = tp > 1 && sp && !recompute ? M : Mx;  // rows of the saved norm outputs
  const size_t cs = dtype_size(compute);
  const size_t input = Mx * d * 4;  // x (f32)
  // h (f32), rstd1, rstd2; qkv, attn, lse (f32); gu (f32): what `op` saves besides x.
  const size_t op_block = input + Mx * d * 4 + Mx * 4 * 2 + M * (Hq + 2 * Hkv) * hd * 4 +
                          M * Hq * hd * 4 + size_t(B) * Hq * size_t(T) * 4 + M * 2 * F * 4;
  // + xn1, xn2 (compute dtype) and act.
  const size_t block = op_block + Mn * d * cs * 2 + M * F * cs;
  const size_t L = size_t(c.num_hidden_layers);
  switch (ac.mode) {
    case ActivationCheckpoint::Mode::none:
      return block * L;
    case ActivationCheckpoint::Mode::op:
      // The backward of a block holds its recomputed act (the norm output recomputed later is
      // smaller).
      return op_block * L + M * F * cs;
    case ActivationCheckpoint::Mode::full:
      break;
  }
  // At the head every block's saved tensors; in the backward of a recomputed block l, blocks
  // 0..l-1's plus block l's whole set. The last recomputed block gives the largest of those.
  size_t all = 0, peak = 0;
  for (size_t l = 0; l < L; ++l) {
    const bool full = ac.block_mode(int64_t(l)) == ActivationCheckpoint::Mode::full;
    if (full) peak = all + block;
    all += full ? input : block;
  }
  return std::max(all, peak);
}

uint64_t LlamaModel::tp_bytes_per_micro_batch(int64_t B, int64_t T) const {
  const int n = tp_->opt.size();
  if (n == 1) return 0;
  // The ProcessGroup's ring convention (docs/design.md, "Distributed runtime").
  auto ar = [n](uint64_t bytes) { return 2 * uint64_t(n - 1) * bytes / uint64_t(n); };
  const uint64_t M = uint64_t(B * T), d = uint64_t(config_.hidden_size), L = blocks_.size();
  const uint64_t cs = dtype_size(compute_), k = uint64_t(n - 1);
  const uint64_t loss = k * M * 4 + ar(M * 4);  // all-gather of the local lse, target logits
  const uint64_t recomputed = recomputed_blocks();
  // Without SP a recomputed forward all-reduces the attention output once more.
  if (!tp_->sp()) return ar(M * d * 4) * (2 + 4 * L + recomputed) + loss;
  const uint64_t rows = M / uint64_t(n) * d;  // one rank's block of a [M, d] tensor
  const uint64_t ag_x = k * rows * cs, f32 = k * rows * 4;
  const uint64_t per_block = 2 * ag_x + 2 * f32                   // forward
                             + 2 * f32 + 2 * f32 + 2 * ar(d * 4)  // backward: dy, dx, norms
                             + (tp_->opt.recompute_allgather ? 2 * ag_x : 0);
  // `op` gathers the recomputed norm outputs in backward (as recompute_allgather does).
  const uint64_t op =
      ac_.mode == ActivationCheckpoint::Mode::op && !tp_->opt.recompute_allgather ? 2 * ag_x : 0;
  // A recomputed forward: the two gathers and the attention's reduce-scatter (not the MLP's).
  return f32                                                     // embedding reduce-scatter
         + (per_block + op) * L + recomputed * (2 * ag_x + f32)  // blocks
         + ag_x + loss + f32 + ar(d * 4)                         // head
         + f32;                                                  // embedding backward all-gather
}

int64_t LlamaModel::recomputed_blocks() const {
  int64_t n = 0;
  for (size_t l = 0; l < blocks_.size(); ++l)
    n += ac_.block_mode(int64_t(l)) == ActivationCheckpoint::Mode::full;
  return n;
}

size_t LlamaModel::ring_kv_bytes(int64_t B, int64_t T) const {
  // This rank's B*T rows of the local kv heads' K and V, f32.
  const size_t tpn = size_t(tp_->opt.size());
  return size_t(B * T) * 2 * size_t(config_.num_key_value_heads) / tpn *
         size_t(config_.head_dim()) * 4;
}

uint64_t LlamaModel::cp_bytes_per_micro_batch(int64_t B, int64_t T) const {
  const int n = tp_->cp.size();
  if (n == 1) return 0;
  const uint64_t k = uint64_t(n - 1), kv = ring_kv_bytes(B, T);
  // p2p: forward sends K/V n-1 times; backward the same plus n hops of the dK/dV accumulator.
  // allgather: the same K/V bytes by all-gather, and a reduce-scatter of n blocks of dK/dV.
  // The forward runs again for the blocks that full checkpointing recomputes.
  const uint64_t forward = k * kv, backward = tp_->cp.allgather ? 2 * k * kv : (2 * k + 1) * kv;
  return (forward + backward) * uint64_t(blocks_.size()) + forward * uint64_t(recomputed_blocks());
}

size_t LlamaModel::ring_working_bytes(int64_t B, int64_t T) const {
  const int n = tp_->cp.size();
  if (n == 1) return 0;
  const size_t Hq = size_t(config_.num_attention_heads / tp_->opt.size());
  const size_t blocks = tp_->cp.allgather ? 2 * size_t(n) + 1 : 5;
  return blocks * ring_kv_bytes(B, T) + size_t(B * T) * Hq * 4;
}

}  // namespace loom
