#include "parallel/layers/tensor_parallel.hpp"

#include <algorithm>
#include <vector>

#include "distributed/process_group.hpp"

namespace loom {

int TpOptions::size() const {
  return group ? group->size() : 1;
}
int TpOptions::rank() const {
  return group ? group->rank() : 0;
}

Tensor tp_pooled(const TpRuntime& tp, dist::BufferPurpose purpose, const Shape& shape, DType dt,
                 Device dev) {
  const MemoryUseScope use(dev, MemoryUse::communication);
  return tp.pool->get(purpose, dt, shape_numel(shape), dev).view(shape);
}

void tp_all_reduce(const TpRuntime& tp, Tensor& t) {
  tp.opt.group->all_reduce(t.view({t.numel()}), dist::ReduceOp::sum)->wait();
}

void tp_gather_rows(const TpRuntime& tp, const Tensor& in, Tensor& out) {
  tp.opt.group->all_gather(in.view({in.numel()}), out.view({out.numel()}))->wait();
}

void tp_reduce_scatter_rows(const TpRuntime& tp, const Tensor& in, Tensor& out) {
  tp.opt.group->reduce_scatter(in.view({in.numel()}), out.view({out.numel()}), dist::ReduceOp::sum)
      ->wait();
}

Tensor tp_gather_input(const TpRuntime& tp, const Tensor& local) {
  const int64_t M = local.size(0) * tp.opt.size();
  Tensor full = tp_pooled(tp, dist::BufferPurpose::ag_input, {M, local.size(1)}, local.dtype(),
                          local.device());
  tp_gather_rows(tp, local, full);
  return full;
}

void column_parallel_forward(const TpRuntime& tp, const Tensor& local, const Tensor& w,
                             bool keep_gathered, Tensor& saved, Tensor& y) {
  if (!tp.sp()) {
    saved = local;
    ops::linear(local, w, y);
    return;
  }
  const int64_t Mx = local.size(0), M = Mx * tp.opt.size(), d = local.size(1);
  const Device dev = local.device();
  Tensor full;
  if (keep_gathered) {
    saved = full = Tensor::empty({M, d}, local.dtype(), dev);
  } else {
    saved = local;
    full = tp_pooled(tp, dist::BufferPurpose::ag_input, {M, d}, local.dtype(), dev);
  }
  if (!tp.opt.async || !ops::computes(dev)) {
    tp_gather_rows(tp, local, full);
    ops::linear(full, w, y);
    return;
  }
  // The local rows need no gather: their GEMM runs in chunks while the gather is in flight
  // (Work::test drives MPI between chunks), then the other ranks' rows.
  auto work = tp.opt.group->all_gather(local.view({local.numel()}), full.view({full.numel()}));
  const int64_t r0 = int64_t(tp.opt.rank()) * Mx, chunks = 4;
  const int64_t step = (Mx + chunks - 1) / chunks;
  for (int64_t i = 0; i < Mx; i += step) {
    const int64_t n = std::min(step, Mx - i);
    Tensor out = y.narrow(0, r0 + i, n);
    ops::linear(local.narrow(0, i, n), w, out);
    work->test();
  }
  work->wait();
  if (r0 > 0) {
    Tensor out = y.narrow(0, 0, r0);
    ops::linear(full.narrow(0, 0, r0), w, out);
  }
  if (r0 + Mx < M) {
    Tensor out = y.narrow(0, r0 + Mx, M - r0 - Mx);
    ops::linear(full.narrow(0, r0 + Mx, M - r0 - Mx), w, out);
  }
}

Tensor column_parallel_backward(const TpRuntime& tp, const Tensor& dout, const Tensor& in,
                                const Tensor& w, const ops::WeightGrad& dw) {
  const int64_t M = dout.size(0), d = in.size(1);
  const Device dev = dout.device();
  if (!tp.on()) {
    Tensor dx = Tensor::empty({M, d}, DType::f32, dev);
    ops::linear_backward(dout, in, w, dw, dx);
    return dx;
  }
  Tensor part = tp_pooled(tp, dist::BufferPurpose::col_dx, {M, d}, DType::f32, dev);
  ops::linear_backward(dout, in, w, dw, part);
  return tp_sum_partial(tp, part);
}

Tensor tp_sum_partial(const TpRuntime& tp, Tensor& part) {
  if (!tp.sp()) {
    tp_all_reduce(tp, part);
    return part;
  }
  Tensor mine = tp_pooled(tp, dist::BufferPurpose::col_dx_rs,
                          {part.size(0) / tp.opt.size(), part.size(1)}, DType::f32, part.device());
  tp_reduce_scatter_rows(tp, part, mine);
  return mine;
}

Tensor row_parallel_forward(const TpRuntime& tp, const Tensor& in, const Tensor& w,
                            const Tensor& residual) {
  const Device dev = residual.device();
  Tensor out = Tensor::empty(residual.shape(), DType::f32, dev);
  if (!tp.on()) {
    ops::linear(in, w, residual, out);
    return out;
  }
  out.copy_from(residual);
  Tensor part =
      tp_pooled(tp, dist::BufferPurpose::row_out, {in.size(0), residual.size(1)}, DType::f32, dev);
  ops::linear(in, w, part);
  Tensor sum = part;
  if (tp.sp()) {
    sum = tp_pooled(tp, dist::BufferPurpose::row_out_rs, residual.shape(), DType::f32, dev);
    tp_reduce_scatter_rows(tp, part, sum);
  } else {
    tp_all_reduce(tp, part);
  }
  ops::add_inplace(out, sum);
  return out;
}

void row_parallel_backward(const TpRuntime& tp, const Tensor& dy, const Tensor& in, const Tensor& w,
                           const ops::WeightGrad& dw, Tensor& din, DType compute) {
  // The backward of the reduce-scatter is an all-gather: the gradient of every row.
  Tensor full = dy;
  if (tp.sp()) {
    full = tp_pooled(tp, dist::BufferPurpose::ag_dy, {in.size(0), dy.size(1)}, DType::f32,
                     dy.device());
    tp_gather_rows(tp, dy, full);
  }
  ops::linear_backward(ops::to_compute(full, compute), in, w, dw, din);
}

void vocab_parallel_embedding_forward(const TpRuntime& tp, const Tensor& tokens,
                                      const Tensor& table, int64_t v0, Tensor& x) {
  if (!tp.on()) {
    ops::embedding_forward(tokens, table, x);
    return;
  }
  // Rows of other ranks' tokens are zero here; the sum over tp is the embedding.
  const int64_t M = tokens.numel();
  Tensor part = tp_pooled(tp, dist::BufferPurpose::row_out, {M, x.size(1)}, DType::f32, x.device());
  ops::embedding_forward_range(tokens, table, v0, part);
  if (tp.sp()) {
    tp_reduce_scatter_rows(tp, part, x);
  } else {
    tp_all_reduce(tp, part);
    x.copy_from(part);
  }
}

void vocab_parallel_embedding_backward(const TpRuntime& tp, const Tensor& tokens, const Tensor& dx,
                                       int64_t v0, Tensor& dtable) {
  if (!tp.on()) {
    ops::embedding_backward(tokens, dx, dtable);
    return;
  }
  Tensor full = dx;
  if (tp.sp()) {
    full = tp_pooled(tp, dist::BufferPurpose::ag_dy, {tokens.numel(), dx.size(1)}, DType::f32,
                     dx.device());
    tp_gather_rows(tp, dx, full);
  }
  ops::embedding_backward_range(tokens, full, v0, dtable);
}

void vocab_parallel_cross_entropy(const TpRuntime& tp, const ops::LinearCrossEntropy& a, int64_t v0,
                                  int64_t vocab) {
  LOOM_CHECK(a.loss.defined(), "vocab_parallel_cross_entropy: no loss tensor to write");
  if (!tp.on()) {
    ops::linear_cross_entropy(a);
    return;
  }
  // This rank's logits [rows, V/tp] per chunk; the row's log-sum-exp combines the ranks' local
  // ones (an all-gather of [tp, N]), the target logit comes from the rank that owns it (an
  // all-reduce sum of the masked target logit).
  const int n = tp.opt.size();
  const Device dev = a.x.device();
  const int64_t N = a.x.size(0), V = a.V;
  const int64_t rows = std::max<int64_t>(1, std::min(a.chunk_rows > 0 ? a.chunk_rows : 64, N));
  Tensor lse_all = tp_pooled(tp, dist::BufferPurpose::ce_lse_all, {int64_t(n), N}, DType::f32, dev);
  Tensor lse = lse_all.narrow(0, tp.opt.rank(), 1).view({N});
  Tensor tgt = tp_pooled(tp, dist::BufferPurpose::ce_target, {N}, DType::f32, dev);
  // The logits chunk is the loss's workspace (sized by the memory budget of the chunk rows), not
  // a communication buffer: allocated here, as the single-rank loss does.
  const MemoryUseScope use(dev, MemoryUse::loss);
  Tensor logits = Tensor::empty({rows, V}, DType::f32, dev);
  // Columns past the real vocabulary are padding (a vocabulary tp does not divide): never
  // predicted, so left out of the softmax and given no gradient.
  const int64_t Vr = std::clamp<int64_t>(vocab - v0, 0, V);
  // Targets on the host are checked here; a GPU's were checked on the host where they were made
  // (Model::micro_batch).
  if (a.targets.device() == Device::cpu)
    for (int64_t i = 0; i < N; ++i) {
      const int32_t t = a.targets.data<int32_t>()[i];
      LOOM_CHECK(t < vocab, "cross-entropy: target ", t, " of row ", i,
                 " is outside the vocabulary of ", vocab);
    }
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    Tensor l = logits.narrow(0, 0, nr), ls = lse.narrow(0, r0, nr), tg = tgt.narrow(0, r0, nr);
    ops::linear(a.x.narrow(0, r0, nr), a.w, l);
    ops::vocab_shard_lse(l, Vr, a.targets.narrow(0, r0, nr), v0, ls, tg);
  }
  // In place: this rank's row of lse_all is its input block.
  tp.opt.group->all_gather(lse, lse_all.view({int64_t(n) * N}))->wait();
  tp_all_reduce(tp, tgt);
  Tensor glse = Tensor::empty({N}, DType::f32, dev);
  Tensor loss = a.loss;  // shares its storage
  ops::vocab_shard_combine(lse_all, a.targets, tgt, glse, loss);
  Tensor dl_c = a.x.dtype() == DType::f32
                    ? logits
                    : tp_pooled(tp, dist::BufferPurpose::ce_dlogits, {rows, V}, DType::bf16, dev);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    Tensor l = logits.narrow(0, 0, nr), dl = dl_c.narrow(0, 0, nr);
    const Tensor x = a.x.narrow(0, r0, nr);
    ops::linear(x, a.w, l);
    ops::vocab_shard_dlogits(l, Vr, a.targets.narrow(0, r0, nr), v0, glse.narrow(0, r0, nr),
                             a.grad_scale);
    if (a.x.dtype() == DType::bf16) ops::cast(l, dl);
    Tensor dx = a.dx.narrow(0, r0, nr);
    ops::linear_backward(dl, x, a.w, a.dw, dx);
  }
}

}  // namespace loom
