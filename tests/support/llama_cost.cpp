// The cost oracle's formulas of LlamaModel (tests/support/model_cost.hpp): what a LlamaBlock saves
// for its backward, its working buffers and the tp and cp layers' collectives, by hand.
#include <algorithm>

#include "core/allocator.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "tests/support/model_cost.hpp"

namespace loom::oracle {

namespace {

// The CPU kernel's scratch for N rows of x (D wide, dtype ab) with these chunk settings, with
// gradients: one chunk of f32 logits, of bf16 logit gradients (bf16), and the head's weight packed
// once for all chunks (cpu::linear_cross_entropy_packed_bytes).
size_t loss_scratch_bytes(int64_t N, int64_t D, int64_t V, DType ab, int64_t chunk_rows,
                          int64_t grad_rows) {
  if (N == 0) return 0;
  const bool grad16 = ab == DType::bf16;
  const cpu::LinearCrossEntropyChunks ch =
      cpu::linear_cross_entropy_chunks(N, V, chunk_rows, grad16 ? grad_rows : 0);
  return size_t(ch.rows) * size_t(V) * 4 + (grad16 ? size_t(ch.grad_rows) * size_t(V) * 2 : 0) +
         cpu::linear_cross_entropy_packed_bytes(N, D, V, ab, ch, grad16);
}

// In bf16 the attention frees the f32 qkv GEMM output just before the block makes the tensors
// below, and the allocator hands the first of them that asks for at most that block's size and
// at least 80% of it the whole block (Allocator::allocate's 25% reuse margin): the difference is
// held for as long as that tensor is. Returns it, and whether `op` keeps the tensor too (`none`
// keeps every one of them but the transient f32 gate/up, `full` recomputes into a cache that
// holds blocks of every size and measures without it).
struct CacheSlack {
  size_t bytes = 0;
  bool op = false;
};
CacheSlack qkv_block_slack(size_t M, size_t Mx, size_t d, size_t nqkv, size_t q, size_t F,
                           bool gathered_xn2) {
  const size_t freed = Allocator::round_size(M * nqkv * 4);
  struct Made {
    size_t bytes;
    bool saved, op;
  };
  // attn, the residual h, xn2 (every row, gathered under SP), gu, act.
  const Made made[] = {{M * q * 2, true, true},     {Mx * d * 4, true, true},
                       {Mx * d * 2, true, false},   {gathered_xn2 ? M * d * 2 : 0, true, false},
                       {M * 2 * F * 2, true, true}, {M * F * 2, true, false}};
  for (const Made& m : made) {
    if (m.bytes == 0) continue;
    const size_t r = Allocator::round_size(m.bytes);
    if (r <= freed && freed <= r + r / 4)
      return m.saved ? CacheSlack{freed - r, m.op} : CacheSlack{};
  }
  return {};
}

}  // namespace

LlamaActivations llama_activations(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                   int tp, bool sp, bool recompute,
                                   const ActivationCheckpoint& ac) {
  const size_t n = size_t(tp), M = size_t(B * T), d = c.hidden_size, hd = c.head_dim();
  const size_t Hq = c.num_attention_heads / n, Hkv = c.num_key_value_heads / n;
  const size_t F = c.intermediate_size / n;
  const size_t Mx = tp > 1 && sp ? M / n : M;             // rows of the residual stream
  const size_t Mn = tp > 1 && sp && !recompute ? M : Mx;  // rows of the saved norm outputs
  const size_t cs = dtype_size(compute);
  const size_t input = Mx * d * cs;  // x, saved in the compute dtype
  // In bf16 the f32 input a block's forward reads, beside its saved copy; a recomputation reads
  // the copy widened.
  const size_t live = cs == 4 ? 0 : Mx * d * 4;
  // h (f32), rstd1, rstd2, lse (f32); qkv, attn, gu (compute dtype): what `op` saves besides x.
  const size_t op_block = input + Mx * d * 4 + Mx * 4 * 2 + M * (Hq + 2 * Hkv) * hd * cs +
                          M * Hq * hd * cs + size_t(B) * Hq * size_t(T) * 4 + M * 2 * F * cs;
  // + xn1, xn2 (compute dtype) and act.
  const size_t act = M * F * cs;
  const size_t block = op_block + Mn * d * cs * 2 + act;
  // A block's working buffers beyond its saved set: its forward holds nothing beyond the f32
  // input (`live`; the gate/up GEMM writes its output in the compute dtype, rounded in the GEMM,
  // where it once held an f32 copy); its backward starts with the gradient from above (f32), the
  // SwiGLU's f32 gradient and, in bf16, the former rounded for the down projection's GEMM.
  const size_t backward = Mx * d * 4 + M * F * 4 + (cs == 4 ? 0 : Mx * d * 2);
  const size_t L = size_t(c.num_hidden_layers);
  const CacheSlack slack = cs == 4 ? CacheSlack{}
                                   : qkv_block_slack(M, Mx, d, (Hq + 2 * Hkv) * hd, Hq * hd, F,
                                                     tp > 1 && sp && !recompute);
  switch (ac.mode) {
    case ActivationCheckpoint::Mode::none: {
      const size_t all = (block + slack.bytes) * L;
      return {all, all + std::max(live, backward), all + backward};
    }
    case ActivationCheckpoint::Mode::op: {
      // The backward of a block also holds its recomputed act (the norm output recomputed later
      // is smaller); the forward holds no act.
      const size_t all = (op_block + (slack.op ? slack.bytes : 0)) * L;
      return {all, all + std::max(live, act + backward), all + act + backward};
    }
    case ActivationCheckpoint::Mode::full:
      break;
  }
  // At the head every block's saved tensors; in the forward of block l, and in the backward of a
  // recomputed block l, blocks 0..l-1's plus block l's whole set and its working buffers.
  // A recomputation runs with the gradient from above alive.
  size_t all = 0, peak = 0, in_backward = 0;
  for (size_t l = 0; l < L; ++l) {
    const bool full = ac.block_mode(int64_t(l)) == ActivationCheckpoint::Mode::full;
    const size_t saved = full ? block : block + slack.bytes;
    peak = std::max(peak, all + saved + std::max(live + (full ? Mx * d * 4 : 0), backward));
    in_backward = std::max(in_backward,
                           all + saved + (full ? std::max(live + Mx * d * 4, backward) : backward));
    all += full ? input : saved;
  }
  return {all, std::max(all, peak), in_backward};
}

namespace {

int tp_of(const LlamaModel& m) {
  return m.tp().size();
}
bool sp_of(const LlamaModel& m) {
  return m.tp().size() > 1 && m.tp().sequence_parallel;
}
LlamaActivations activations_of(const LlamaModel& m, int64_t B, int64_t T) {
  return llama_activations(m.config(), B, T, m.compute_dtype(), tp_of(m), sp_of(m),
                           m.tp().recompute_allgather, m.activation_checkpoint());
}
// This rank's B*T rows of the local kv heads' K and V.
size_t kv_bytes_of(const LlamaModel& m, int64_t B, int64_t T) {
  return ring_kv_bytes(B * T, m.config().num_key_value_heads / tp_of(m), m.config().head_dim());
}

}  // namespace

size_t saved_activation_bytes(const LlamaModel& m, int64_t B, int64_t T) {
  return activations_of(m, B, T).peak;
}

size_t saved_at_head_bytes(const LlamaModel& m, int64_t B, int64_t T) {
  return activations_of(m, B, T).at_head;
}

size_t backward_peak_bytes(const LlamaModel& m, int64_t B, int64_t T) {
  return activations_of(m, B, T).backward;
}

uint64_t tp_bytes_per_micro_batch(const LlamaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs) {
  const TpOptions& tp = m.tp();
  const int n = tp.size();
  if (n == 1) return 0;
  // The ProcessGroup's ring convention (docs/decisions/distributed-runtime.md).
  auto ar = [n](uint64_t bytes) { return 2 * uint64_t(n - 1) * bytes / uint64_t(n); };
  const uint64_t M = uint64_t(B * T), d = uint64_t(m.config().hidden_size);
  const RunBlocks rb = run_blocks(m, runs);
  const uint64_t cs = dtype_size(m.compute_dtype()), k = uint64_t(n - 1), L = rb.blocks;
  const uint64_t loss = k * M * 4 + ar(M * 4);  // all-gather of the local lse, target logits
  const uint64_t recomputed = rb.recomputed;
  // Without SP a recomputed forward all-reduces the attention output once more; the embedding's
  // forward and the head's backward all-reduce once each.
  if (!tp.sequence_parallel)
    return ar(M * d * 4) * (rb.embed + rb.head + 4 * L + recomputed) + (rb.head ? loss : 0);
  const uint64_t rows = M / uint64_t(n) * d;  // one rank's block of a [M, d] tensor
  const uint64_t ag_x = k * rows * cs, f32 = k * rows * 4;
  const uint64_t per_block = 2 * ag_x + 2 * f32                   // forward
                             + 2 * f32 + 2 * f32 + 2 * ar(d * 4)  // backward: dy, dx, norms
                             + (tp.recompute_allgather ? 2 * ag_x : 0);
  // `op` gathers the recomputed norm outputs in backward (as recompute_allgather does).
  const uint64_t op =
      m.activation_checkpoint().mode == ActivationCheckpoint::Mode::op && !tp.recompute_allgather
          ? 2 * ag_x
          : 0;
  // A recomputed forward: the two gathers and the attention's reduce-scatter (not the MLP's).
  return (per_block + op) * L + recomputed * (2 * ag_x + f32)  // blocks
         + (rb.head ? ag_x + loss + f32 + ar(d * 4) : 0)       // head
         + (rb.embed ? 2 * f32 : 0);  // embedding: forward reduce-scatter, backward all-gather
}

uint64_t cp_bytes_per_micro_batch(const LlamaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs) {
  const RunBlocks rb = run_blocks(m, runs);
  return ring_bytes(m.cp(), kv_bytes_of(m, B, T), rb.blocks, rb.recomputed);
}

size_t ring_working_bytes(const LlamaModel& m, int64_t B, int64_t T) {
  return ring_working_bytes(m.cp(), kv_bytes_of(m, B, T), B * T,
                            m.config().num_attention_heads / tp_of(m));
}

UnitActivations unit_activation_bytes(const LlamaModel& m, size_t unit, int64_t B, int64_t T) {
  const LlamaConfig& c = m.config();
  const int n = tp_of(m);
  const bool sp = sp_of(m), recompute = m.tp().recompute_allgather;
  const size_t M = size_t(B * T), Mx = sp ? M / size_t(n) : M, d = size_t(c.hidden_size);
  UnitActivations u;
  if (unit == 0) return u;
  if (unit == m.num_units() - 1) {
    u.saved = Mx * d * 4;
    u.backward = u.backward_input = head_workspace_bytes(m, B, T) - u.saved;  // nothing deferred
    return u;
  }
  const auto mode = m.activation_checkpoint().block_mode(int64_t(unit - 1));
  const DType compute = m.compute_dtype();
  // One block of each mode, from the whole-model figure of a one-block config (the same sums).
  LlamaConfig one = c;
  one.num_hidden_layers = 1;
  auto block = [&](ActivationCheckpoint::Mode mo) {
    ActivationCheckpoint a;
    a.mode = mo;
    return llama_activations(one, B, T, compute, n, sp, recompute, a).at_head;
  };
  const size_t cs = dtype_size(compute), F = size_t(c.intermediate_size / n);
  const size_t hd = size_t(c.head_dim()), Hq = size_t(c.num_attention_heads / n);
  const size_t Hkv = size_t(c.num_key_value_heads / n), nqkv = (Hq + 2 * Hkv) * hd;
  const size_t input = Mx * d * cs;             // x, saved in the compute dtype
  const size_t Mn = sp && !recompute ? M : Mx;  // rows of the saved norm outputs
  const bool bf16 = cs == 2;
  // In bf16 the f32 input the forward reads (and a recomputation, widened) beside the saved copy.
  const size_t live = bf16 ? Mx * d * 4 : 0;
  const size_t act = M * F * cs, gu = M * 2 * F * cs, qkv = M * nqkv * cs, attn = M * Hq * hd * cs;
  // The backward's MLP phase: the SwiGLU's f32 gradient while everything is held (in bf16 also
  // the output gradient rounded for the down projection's GEMM).
  const size_t mlp = M * F * 4 + (bf16 ? M * d * 2 : 0);
  // Its attention phase: dqkv and dattn (f32), once the MLP branch's tensors are freed. In bf16
  // the attention kernels read the saved bf16 qkv and attention output themselves; only ring
  // attention (cp) reads them widened to f32 (the bf16 attention output still held as the last
  // one is made, the bf16 qkv freed once widened).
  const bool widened = bf16 && m.cp().size() > 1;
  auto attention_phase = [&](bool saved_act_xn2) {
    const size_t held = M * (nqkv + Hq * hd) * 4 + (widened ? M * (nqkv + Hq * hd) * 4 + attn : 0);
    const size_t freed = gu + (saved_act_xn2 ? act + Mn * d * cs : 0) + Mx * d * 4 + Mx * 4 +
                         (widened ? qkv + attn : 0);
    return held > freed ? held - freed : 0;
  };
  switch (mode) {
    case ActivationCheckpoint::Mode::none:
      u.saved = block(mode);
      u.forward = live;
      u.backward = std::max(mlp, attention_phase(true));
      break;
    case ActivationCheckpoint::Mode::op:
      u.saved = block(mode);
      u.forward = live;
      u.backward = std::max(mlp + act, attention_phase(false));
      break;
    case ActivationCheckpoint::Mode::full: {
      u.saved = input;
      // Its forward saves everything until the block's end, its backward does so again.
      const size_t all = block(ActivationCheckpoint::Mode::none) - input;
      u.forward = all + live;
      u.backward = all + std::max({live, mlp, attention_phase(true)});
      break;
    }
  }
  // Each linear layer's output gradient (copied) and input (kept, or copied under tp), as its GEMM
  // reads them: qkv (dqkv, xn1), o (dy, attn), gate/up (dgu, xn2), down (dy, act).
  u.deferred = M * cs * (nqkv + d + 2 * F + d + d + Hq * hd + d + F);
  // In I nothing the deferred GEMMs read is freed. Its MLP phase: the gate/up's input gradient is
  // computed with the down projection's output gradient copied, dgu (in place, in the compute
  // dtype) and its copy, and dxn2 live, beyond the backward's own start without dact. Its
  // attention phase: those copies and the o projection's, with the attention's buffers as in B,
  // gu, h (and under cp the widened bf16 qkv) freed (act, xn2 and the attention output are kept
  // for W).
  const size_t recomputed = mode == ActivationCheckpoint::Mode::full
                                ? block(ActivationCheckpoint::Mode::none) - input
                            : mode == ActivationCheckpoint::Mode::op ? act
                                                                     : 0;
  const size_t copies = M * cs * (d + 2 * F + d);
  const size_t attention_i = M * (nqkv + Hq * hd) * 4 * (widened ? 2 : 1) + copies;
  const size_t freed_i = gu + Mx * d * 4 + Mx * 4 + (widened ? qkv : 0);
  u.backward_input = std::max({mlp - M * F * 4 + recomputed + M * (d * cs + 2 * F * cs + d * 4),
                               u.backward + M * d * cs,
                               recomputed + (attention_i > freed_i ? attention_i - freed_i : 0)});
  return u;
}

// The fused output projection + loss at the start of the head's backward.
size_t head_workspace_bytes(const LlamaModel& m, int64_t B, int64_t T) {
  const LlamaConfig& c = m.config();
  const DType compute = m.compute_dtype();
  const int n = tp_of(m);
  const bool sp = sp_of(m);
  const size_t M = size_t(B * T), d = size_t(c.hidden_size);
  // One rank: the kernel's f32 logits and bf16 gradients (cpu::linear_cross_entropy_chunks);
  // tp: a chunk of both (vocab_parallel_cross_entropy, which takes no gradient groups).
  const LlamaModel::LossChunks ch = LlamaModel::loss_chunks(c, B, T, compute);
  const bool bf16 = compute == DType::bf16;
  const size_t Vn = size_t(c.vocab_size / n);
  const size_t logits_chunk = n == 1 ? loss_scratch_bytes(int64_t(M), int64_t(d), int64_t(Vn),
                                                          compute, ch.rows, ch.grad_rows)
                                     : size_t(ch.rows) * Vn * (4 + (bf16 ? 2 : 0));
  // The last block's output x, the normalized xf in the compute dtype, its gradient dxf (f32),
  // rstd, and the loss's chunk of logits.
  if (n == 1) return M * d * (4 + dtype_size(compute) + 4) + M * 4 + logits_chunk;
  // With tp: x, xf and rstd of this rank's rows, the loss's glse; the gathered xf, dxf and the
  // lse are pooled communication buffers (tp_comm_buffer_bytes).
  const size_t Mx = sp ? M / size_t(n) : M;
  return Mx * d * (4 + dtype_size(compute)) + Mx * 4 + M * 4 + logits_chunk;
}

size_t tp_comm_buffer_bytes(const LlamaModel& m, int64_t B, int64_t T) {
  const LlamaConfig& c = m.config();
  const DType compute = m.compute_dtype();
  const int tp = tp_of(m);
  const bool sp = sp_of(m);
  if (tp <= 1) return 0;
  const size_t n = size_t(tp), M = size_t(B * T), d = size_t(c.hidden_size);
  const size_t Mx = sp ? M / n : M;
  // A row-parallel output and a column-parallel input gradient before their sum over tp
  // (BufferPurpose::row_out, col_dx), the loss's gathered log-sum-exps and target logits.
  size_t bytes = 2 * M * d * 4 + n * M * 4 + M * 4;
  if (compute == DType::bf16) {
    // The loss's chunk of logit gradients in bf16 (BufferPurpose::ce_dlogits).
    const int64_t chunk = LlamaModel::loss_chunks(c, B, T, compute).rows;
    const size_t rows =
        size_t(std::max<int64_t>(1, std::min<int64_t>(chunk > 0 ? chunk : 64, int64_t(M))));
    bytes += rows * size_t((c.vocab_size + tp - 1) / tp) * 2;
  }
  // SP: the reduce-scattered rows of both, the gathered GEMM input (compute dtype) and output
  // gradient (f32), and a norm's weight gradient part.
  if (sp) bytes += 2 * Mx * d * 4 + M * d * dtype_size(compute) + M * d * 4 + d * 4;
  return bytes;
}

}  // namespace loom::oracle
