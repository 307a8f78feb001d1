// The analytic memory and communication model of LlamaModel (docs/design.md "Memory model"):
// the figures `loom bench --check` compares with what a step measures.
#include <algorithm>

#include "model/llama.hpp"

namespace loom {

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
  const TpRuntime& tp = par().tp;
  const int n = tp.opt.size();
  if (n == 1) return 0;
  // The ProcessGroup's ring convention (docs/design.md, "Distributed runtime").
  auto ar = [n](uint64_t bytes) { return 2 * uint64_t(n - 1) * bytes / uint64_t(n); };
  const uint64_t M = uint64_t(B * T), d = uint64_t(config_.hidden_size), L = num_blocks();
  const uint64_t cs = dtype_size(compute_), k = uint64_t(n - 1);
  const uint64_t loss = k * M * 4 + ar(M * 4);  // all-gather of the local lse, target logits
  const uint64_t recomputed = uint64_t(activation_checkpoint().recomputed_blocks(int64_t(L)));
  // Without SP a recomputed forward all-reduces the attention output once more.
  if (!tp.sp()) return ar(M * d * 4) * (2 + 4 * L + recomputed) + loss;
  const uint64_t rows = M / uint64_t(n) * d;  // one rank's block of a [M, d] tensor
  const uint64_t ag_x = k * rows * cs, f32 = k * rows * 4;
  const uint64_t per_block = 2 * ag_x + 2 * f32                   // forward
                             + 2 * f32 + 2 * f32 + 2 * ar(d * 4)  // backward: dy, dx, norms
                             + (tp.opt.recompute_allgather ? 2 * ag_x : 0);
  // `op` gathers the recomputed norm outputs in backward (as recompute_allgather does).
  const uint64_t op =
      activation_checkpoint().mode == ActivationCheckpoint::Mode::op && !tp.opt.recompute_allgather
          ? 2 * ag_x
          : 0;
  // A recomputed forward: the two gathers and the attention's reduce-scatter (not the MLP's).
  return f32                                                     // embedding reduce-scatter
         + (per_block + op) * L + recomputed * (2 * ag_x + f32)  // blocks
         + ag_x + loss + f32 + ar(d * 4)                         // head
         + f32;                                                  // embedding backward all-gather
}

size_t LlamaModel::ring_kv_bytes(int64_t B, int64_t T) const {
  // This rank's B*T rows of the local kv heads' K and V.
  return loom::ring_kv_bytes(B * T, config_.num_key_value_heads / tp().size(), config_.head_dim());
}

uint64_t LlamaModel::cp_bytes_per_micro_batch(int64_t B, int64_t T) const {
  const int64_t L = int64_t(num_blocks());
  return ring_bytes(cp(), ring_kv_bytes(B, T), L, activation_checkpoint().recomputed_blocks(L));
}

size_t LlamaModel::ring_working_bytes(int64_t B, int64_t T) const {
  return loom::ring_working_bytes(cp(), ring_kv_bytes(B, T), B * T,
                                  config_.num_attention_heads / tp().size());
}

size_t LlamaModel::saved_activation_bytes(int64_t B, int64_t T) const {
  const int n = tp().size();
  return saved_activation_bytes(config_, B, T, compute_, n, n > 1 && tp().sequence_parallel,
                                tp().recompute_allgather, activation_checkpoint());
}

Model::UnitActivations LlamaModel::unit_activation_bytes(size_t unit, int64_t B, int64_t T) const {
  const int n = tp().size();
  const bool sp = n > 1 && tp().sequence_parallel;
  const size_t M = size_t(B * T), Mx = sp ? M / size_t(n) : M, d = size_t(config_.hidden_size);
  UnitActivations u;
  if (unit == 0) return u;
  if (unit == head_index()) {
    u.saved = Mx * d * 4;
    u.backward = u.backward_input = head_workspace_bytes(B, T) - u.saved;  // nothing deferred
    return u;
  }
  const ActivationCheckpoint& ac = activation_checkpoint();
  const auto mode = ac.block_mode(int64_t(unit - 1));
  // One block of each mode, from the whole-model figure of a one-block config (the same sums).
  LlamaConfig one = config_;
  one.num_hidden_layers = 1;
  auto block = [&](ActivationCheckpoint::Mode m) {
    ActivationCheckpoint a;
    a.mode = m;
    return saved_activation_bytes(one, B, T, compute_, n, sp, tp().recompute_allgather, a);
  };
  const size_t cs = dtype_size(compute_), F = size_t(config_.intermediate_size / n);
  const size_t hd = size_t(config_.head_dim()), Hq = size_t(config_.num_attention_heads / n);
  const size_t Hkv = size_t(config_.num_key_value_heads / n), nqkv = (Hq + 2 * Hkv) * hd;
  const size_t input = Mx * d * 4;
  // The backward starts with the SwiGLU's f32 gradient while everything is held (in bf16 also
  // the output gradient rounded for the down projection's GEMM); later phases have freed more
  // than they allocate.
  u.backward = M * F * 4 + (cs == 2 ? M * d * 2 : 0);
  switch (mode) {
    case ActivationCheckpoint::Mode::none:
      u.saved = block(mode);
      break;
    case ActivationCheckpoint::Mode::op:
      // saved_activation_bytes(op) of one block is its op set plus the recomputed act.
      u.saved = block(mode) - M * F * cs;
      u.backward += M * F * cs;
      break;
    case ActivationCheckpoint::Mode::full:
      u.saved = input;
      // Its forward saves everything until the block's end, its backward does so again.
      u.forward = block(ActivationCheckpoint::Mode::none) - input;
      u.backward += u.forward;
      break;
  }
  // Each linear layer's output gradient (copied) and input (kept, or copied under tp), as its GEMM
  // reads them: qkv (dqkv, xn1), o (dy, attn), gate/up (dgu, xn2), down (dy, act).
  u.deferred = M * cs * (nqkv + d + 2 * F + d + d + Hq * hd + d + F);
  // In I nothing the deferred GEMMs read is freed: the gate/up's input gradient is computed
  // with the down projection's output gradient copied, dgu in the compute dtype and its copy,
  // and dxn2 live (in bf16 dgu is rounded first), beyond the backward's own start.
  u.backward_input = u.backward - M * F * 4 + M * (d * cs + 2 * F * cs * (cs == 2 ? 2 : 1) + d * 4);
  u.backward_input = std::max(u.backward_input, u.backward + M * d * cs);
  return u;
}

// The fused output projection + loss at the start of the head's backward.
size_t LlamaModel::head_workspace_bytes(int64_t B, int64_t T) const {
  const int n = tp().size();
  const bool sp = n > 1 && tp().sequence_parallel;
  const size_t M = size_t(B * T), d = size_t(config_.hidden_size);
  const size_t logits_chunk = size_t(loss_chunk_rows(config_, B, T, compute_)) *
                              size_t(config_.vocab_size / n) *
                              (4 + (compute_ == DType::bf16 ? 2 : 0));
  // The last block's output x, the normalized xf in the compute dtype, its gradient dxf (f32),
  // rstd, and the loss's chunk of logits.
  if (n == 1) return M * d * (4 + dtype_size(compute_) + 4) + M * 4 + logits_chunk;
  // With tp: x, xf and rstd of this rank's rows, the loss's glse; the gathered xf, dxf and the
  // lse are pooled communication buffers (tp_comm_buffer_bytes).
  const size_t Mx = sp ? M / size_t(n) : M;
  return Mx * d * (4 + dtype_size(compute_)) + Mx * 4 + M * 4 + logits_chunk;
}

size_t LlamaModel::tp_comm_buffer_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                        int tp, bool sp) {
  if (tp <= 1) return 0;
  const size_t n = size_t(tp), M = size_t(B * T), d = size_t(c.hidden_size);
  const size_t Mx = sp ? M / n : M;
  // A row-parallel output and a column-parallel input gradient before their sum over tp
  // ("row_out", "col_dx"), the loss's gathered log-sum-exps and target logits.
  size_t bytes = 2 * M * d * 4 + n * M * 4 + M * 4;
  if (compute == DType::bf16) {
    // The loss's chunk of logit gradients in bf16 ("ce_dlogits").
    const int64_t chunk = loss_chunk_rows(c, B, T, compute);
    const size_t rows =
        size_t(std::max<int64_t>(1, std::min<int64_t>(chunk > 0 ? chunk : 64, int64_t(M))));
    bytes += rows * size_t((c.vocab_size + tp - 1) / tp) * 2;
  }
  // SP: the reduce-scattered rows of both, the gathered GEMM input (compute dtype) and output
  // gradient (f32), and a norm's weight gradient part.
  if (sp) bytes += 2 * Mx * d * 4 + M * d * dtype_size(compute) + M * d * 4 + d * 4;
  return bytes;
}

size_t LlamaModel::tp_comm_buffer_bytes(int64_t B, int64_t T) const {
  const int n = tp().size();
  return tp_comm_buffer_bytes(config_, B, T, compute_, n, n > 1 && tp().sequence_parallel);
}

}  // namespace loom
