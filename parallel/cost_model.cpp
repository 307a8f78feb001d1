#include "parallel/cost_model.hpp"

#include <algorithm>
#include <vector>

namespace loom {

namespace {

uint64_t ring_all_gather(uint64_t in_bytes, int n) {
  return uint64_t(n - 1) * in_bytes;
}
uint64_t ring_all_reduce(uint64_t bytes, int n) {
  return n > 1 ? 2 * uint64_t(n - 1) * bytes / uint64_t(n) : 0;
}

// The fused output projection + loss at the start of the head's backward.
size_t head_workspace(const LlamaModel& model, int64_t B, int64_t T) {
  const LlamaConfig& c = model.config();
  const DType compute = model.compute_dtype();
  const int n = model.tp().size();
  const bool sp = n > 1 && model.tp().sequence_parallel;
  const size_t M = size_t(B * T), d = size_t(c.hidden_size);
  const size_t logits_chunk = size_t(LlamaModel::loss_chunk_rows(c, B, T, compute)) *
                              size_t(c.vocab_size / n) * (4 + (compute == DType::bf16 ? 2 : 0));
  // The last block's output x, the normalized xf in the compute dtype, its gradient dxf (f32),
  // rstd, and the loss's chunk of logits.
  if (n == 1) return M * d * (4 + dtype_size(compute) + 4) + M * 4 + logits_chunk;
  // With tp: x, xf and rstd of this rank's rows, the loss's glse; the gathered xf, dxf and the
  // lse are pooled communication buffers (MemoryCost::comm).
  const size_t Mx = sp ? M / size_t(n) : M;
  return Mx * d * (4 + dtype_size(compute)) + Mx * 4 + M * 4 + logits_chunk;
}

}  // namespace

MemoryCost memory_cost(ParallelModel& m, int64_t B, int64_t T) {
  MemoryCost mc;
  LlamaModel& model = *m.model;
  const DType compute = model.compute_dtype();
  // With context parallelism a rank holds the activations of its T / cp tokens.
  const int64_t Tl = T / (m.groups.cp ? m.groups.cp->size() : 1);
  mc.num_params = size_t(model.num_params());
  std::vector<ParamUnit*> units = model.units();
  for (ParamUnit* u : units) {
    const size_t S = size_t(u->shard_numel());
    mc.params += 4 * S;
    mc.grads += 4 * S;
    mc.optimizer += 8 * S;
    if (!u->sharded() && compute == DType::bf16) mc.mirror += 2 * S;
  }
  if (m.fsdp) {
    const size_t head = units.size() - 1;
    for (size_t i = 0; i < units.size(); ++i)
      if (i + 1 >= head || !m.fsdp->reshard_after_forward(i))
        mc.gathered += units[i]->materialized_weight_bytes();
    mc.full_grad = 4 * size_t(units[head]->padded_numel());
    if (model.config().tie_word_embeddings) mc.full_grad += 4 * size_t(units[0]->padded_numel());
  }
  const TpOptions& tp = model.tp();
  const int n = tp.size();
  const bool sp = n > 1 && tp.sequence_parallel;
  mc.activations = LlamaModel::saved_activation_bytes(
      model.config(), B, Tl, compute, n, sp, tp.recompute_allgather, model.activation_checkpoint());
  mc.head = head_workspace(model, B, Tl);
  mc.comm = tp_comm_buffer_bytes(model.config(), B, Tl, compute, n, sp);
  mc.ring = model.ring_working_bytes(B, Tl);
  return mc;
}

uint64_t bytes_per_step(ParallelModel& m, DType reduce, int64_t B, int64_t T, int64_t G) {
  const ParallelGroups& g = m.groups;
  LlamaModel& model = *m.model;
  const int64_t Tl = T / (g.cp ? g.cp->size() : 1);
  // Per micro-batch: tp's and cp's collectives and the 8-byte sum of the loss over cp.
  const uint64_t tp =
      (model.tp_bytes_per_micro_batch(B, Tl) + model.cp_bytes_per_micro_batch(B, Tl) +
       (g.cp ? ring_all_gather(8, g.cp->size()) : 0)) *
          uint64_t(G) +
      (g.tp ? ring_all_gather(8, g.tp->size()) : 0);  // + the gradient norm
  if (!m.fsdp && !m.ddp) return tp;
  const uint64_t rsize = dtype_size(reduce);
  std::vector<ParamUnit*> units = model.units();
  uint64_t per_micro = 0, per_step = g.dp ? ring_all_gather(8, int(g.size)) : 0;  // the loss
  if (m.fsdp) {
    const int n = g.shard->size();
    for (size_t i = 0; i < units.size(); ++i) {
      const ParamUnit& u = *units[i];
      const uint64_t S = uint64_t(u.shard_numel());
      const uint64_t gather = ring_all_gather(S * dtype_size(u.gather_dtype()), n) +
                              ring_all_reduce(uint64_t(u.side_numel()) * 4, n);
      per_micro += gather * (m.fsdp->reshard_after_forward(i) ? 2 : 1);
      per_micro += uint64_t(n - 1) * S * rsize;  // reduce-scatter
      if (g.replicate && g.replicate->size() > 1)
        per_step += ring_all_reduce(S * rsize, g.replicate->size());
    }
    per_step += ring_all_gather(8, n);  // the gradient norm
  } else {
    for (ParamUnit* u : units)
      per_step += ring_all_reduce(uint64_t(u->numel()) * rsize, int(g.size));
  }
  return per_micro * uint64_t(G) + per_step + tp;
}

size_t tp_comm_buffer_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute, int tp,
                            bool sp) {
  if (tp <= 1) return 0;
  const size_t n = size_t(tp), M = size_t(B * T), d = size_t(c.hidden_size);
  const size_t Mx = sp ? M / n : M;
  // A row-parallel output and a column-parallel input gradient before their sum over tp
  // ("row_out", "col_dx"), the loss's gathered log-sum-exps and target logits.
  size_t bytes = 2 * M * d * 4 + n * M * 4 + M * 4;
  if (compute == DType::bf16) {
    // The loss's chunk of logit gradients in bf16 ("ce_dlogits").
    const int64_t chunk = LlamaModel::loss_chunk_rows(c, B, T, compute);
    const size_t rows =
        size_t(std::max<int64_t>(1, std::min<int64_t>(chunk > 0 ? chunk : 64, int64_t(M))));
    bytes += rows * size_t((c.vocab_size + tp - 1) / tp) * 2;
  }
  // SP: the reduce-scattered rows of both, the gathered GEMM input (compute dtype) and output
  // gradient (f32), and a norm's weight gradient part.
  if (sp) bytes += 2 * Mx * d * 4 + M * d * dtype_size(compute) + M * d * 4 + d * 4;
  return bytes;
}

ParallelModel plan_model(const LlamaConfig& config, DType compute, const ParallelGroups& groups,
                         ParallelizeOptions options) {
  options.device = Device::meta;
  return parallelize(config, compute, groups, options);
}

}  // namespace loom
