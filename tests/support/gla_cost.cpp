// The cost oracle's formulas of GlaModel (tests/support/model_cost.hpp, docs/decisions/gla.md):
// what a GLA block saves for its backward (GlaBlockActs' fields one by one;
// tests/model/gla_model_interface_test.cpp checks them against what a step saves), its working
// buffers and the tp layers' and the state passing's collectives, by hand.
#include <algorithm>

#include "tests/support/model_cost.hpp"

namespace loom::oracle {

namespace {

// Rows of the residual stream on this rank (B*T / tp with sequence parallelism).
size_t residual_rows(const GlaModel& m, size_t M) {
  const int n = m.tp().size();
  return n > 1 && m.tp().sequence_parallel ? M / size_t(n) : M;
}

}  // namespace

size_t gla_block_saved_bytes(const GlaModel& m, int64_t B, int64_t T,
                             ActivationCheckpoint::Mode mode) {
  const GlaConfig& c = m.config();
  const int n = m.tp().size();
  const size_t M = size_t(B * T), Mx = residual_rows(m, M);
  const size_t d = size_t(c.hidden_size), cs = dtype_size(m.compute_dtype());
  const size_t Kd = size_t(c.key_dim() / n), Kg = Kd / size_t(c.kv_groups());
  const size_t Vd = size_t(c.value_dim() / n), Vg = Vd / size_t(c.kv_groups());
  const size_t rank = size_t(c.gate_low_rank_dim), F = size_t(c.intermediate_size / n);
  const size_t H = size_t(c.num_heads / n);
  const size_t nproj = Kd + Kg + Vg + (c.use_output_gate ? Vd : 0) + rank;
  const size_t x = Mx * d * cs;  // saved in the compute dtype
  if (mode == ActivationCheckpoint::Mode::full) return x;
  // The GEMM inputs as the GEMMs read them (every row, gathered under SP): xn1, y, xn2, act.
  const size_t gemm_inputs = M * d * cs + M * Vd * cs + M * d * cs + M * F * cs;
  const size_t kept = x + Mx * 4                                         // x, rstd1
                      + M * nproj * 4                                    // proj
                      + (c.use_short_conv ? M * (Kd + Kg + Vg) * 4 : 0)  // qkv_c
                      + M * rank * 4 + 2 * M * Kg * 4                    // r, z, gk
                      + M * Vd * 4 + M * H * 4                           // o, rstd_o
                      + Mx * d * 4 + Mx * 4                              // h, rstd2
                      + M * 2 * F * 4;                                   // gu
  return mode == ActivationCheckpoint::Mode::op ? kept : kept + gemm_inputs;
}

size_t gla_cp_state_bytes(const GlaModel& m, int64_t B) {
  // Context parallelism keeps, per block, the starting state of each of the rank's two zigzag
  // segments [B, H, K, V] and every segment's total decay [2 cp, B, Hkv, K].
  if (m.cp().size() <= 1) return 0;
  const GlaConfig& c = m.config();
  const int n = m.tp().size();
  const size_t S =
      size_t(B) * size_t(c.num_heads / n) * size_t(c.head_k_dim()) * size_t(c.head_v_dim()) * 4;
  return 2 * S + 2 * size_t(m.cp().size()) * size_t(B) * size_t(c.num_kv_heads / n) *
                     size_t(c.head_k_dim()) * 4;
}

size_t saved_activation_bytes(const GlaModel& m, int64_t B, int64_t T) {
  const ActivationCheckpoint& ac = m.activation_checkpoint();
  const size_t block = gla_block_saved_bytes(m, B, T, ActivationCheckpoint::Mode::none);
  const size_t cp_state = gla_cp_state_bytes(m, B);
  // As for Llama: a `full` block recomputed in backward holds everything a plain block saves
  // while the blocks before it hold what they saved.
  size_t all = 0, peak = 0;
  for (size_t l = 0; l < m.num_blocks(); ++l) {
    const ActivationCheckpoint::Mode mode = ac.block_mode(int64_t(l));
    if (mode == ActivationCheckpoint::Mode::full) peak = std::max(peak, all + block);
    all += gla_block_saved_bytes(m, B, T, mode) + cp_state;
  }
  return std::max(all, peak);
}

UnitActivations unit_activation_bytes(const GlaModel& m, size_t unit, int64_t B, int64_t T) {
  const GlaConfig& c = m.config();
  const int n = m.tp().size();
  const size_t M = size_t(B * T), Mx = residual_rows(m, M);
  const size_t d = size_t(c.hidden_size), cs = dtype_size(m.compute_dtype());
  UnitActivations u;
  if (unit == 0) return u;
  if (unit == m.num_units() - 1) {
    u.saved = Mx * d * 4;
    u.backward = u.backward_input = head_workspace_bytes(m, B, T) - u.saved;  // nothing deferred
    return u;
  }
  const ActivationCheckpoint::Mode mode = m.activation_checkpoint().block_mode(int64_t(unit - 1));
  const size_t Kd = size_t(c.key_dim() / n), Kg = Kd / size_t(c.kv_groups());
  const size_t Vd = size_t(c.value_dim() / n), Vg = Vd / size_t(c.kv_groups());
  const size_t rank = size_t(c.gate_low_rank_dim), F = size_t(c.intermediate_size / n);
  const size_t nproj = Kd + Kg + Vg + (c.use_output_gate ? Vd : 0) + rank;
  u.saved = gla_block_saved_bytes(m, B, T, mode) + gla_cp_state_bytes(m, B);
  // The MLP's f32 gradient first (bf16: with the rounded output gradient); `full` recomputes the
  // block's set first, `op` its GEMM inputs.
  u.backward = M * F * 4 + (cs == 2 ? M * d * 2 : 0);
  // In bf16 the f32 input the forward reads (and a recomputation, widened) beside the saved copy.
  u.forward = cs == 2 ? Mx * d * 4 : 0;
  if (mode == ActivationCheckpoint::Mode::full) {
    u.forward += gla_block_saved_bytes(m, B, T, ActivationCheckpoint::Mode::none) - Mx * d * cs;
    u.backward += u.forward;
  }
  if (mode == ActivationCheckpoint::Mode::op) u.backward += M * F * cs;
  // Output gradient and input of each GEMM: down, gate/up, o, the gate's low-rank, proj (not
  // deferred under tp: GlaBlock::backward sums its gk_proj.0 rows right after it).
  u.deferred = M * cs * (d + F + 2 * F + d + d + Vd + Kg + rank + (n > 1 ? 0 : nproj + d));
  // In I the copies pile up: the MLP's as for Llama.
  u.backward_input = u.backward - M * F * 4 + M * (d * cs + 2 * F * cs * (cs == 2 ? 2 : 1) + d * 4);
  u.backward_input = std::max(u.backward_input, u.backward + M * d * cs);
  return u;
}

// The final norm's input, output (f32 and in the compute dtype), the gradient of every row, rstd
// and one chunk of logits of the fused loss (ops::LinearCrossEntropy's default: ~16 MiB).
size_t head_workspace_bytes(const GlaModel& m, int64_t B, int64_t T) {
  const size_t M = size_t(B * T), Mx = residual_rows(m, M);
  const size_t d = size_t(m.config().hidden_size), V = size_t(m.config().vocab_size);
  const DType compute = m.compute_dtype();
  const size_t per_row = V * (4 + (compute == DType::bf16 ? 2 : 0));
  const size_t rows = std::clamp<size_t>((size_t(16) << 20) / (V * 4), 1, M);
  return Mx * d * (4 + 4 + dtype_size(compute)) + M * d * 4 + Mx * 4 + rows * per_row;
}

// The pooled buffers of the tp layers: a row-parallel output and a column-parallel input
// gradient before their sum (BufferPurpose::row_out, col_dx), and with SP the gathered GEMM input
// and output gradient and the reduce-scattered rows. An estimate (GLA's gathers are of several
// widths, the widest counted), not compared with the pool itself; the peaks of the bench checks
// under TP 2 are within 1.5% with it.
size_t tp_comm_buffer_bytes(const GlaModel& m, int64_t B, int64_t T) {
  const int n = m.tp().size();
  if (n <= 1) return 0;
  const size_t M = size_t(B * T), d = size_t(m.config().hidden_size);
  const bool sp = m.tp().sequence_parallel;
  const size_t Mx = sp ? M / size_t(n) : M;
  size_t bytes = 2 * M * d * 4;
  if (sp) bytes += 2 * Mx * d * 4 + M * d * dtype_size(m.compute_dtype()) + M * d * 4 + d * 4;
  return bytes;
}

// The tp layers' collectives (the ProcessGroup's ring convention, as LlamaModel's). Per block:
// the two column-parallel GEMMs gather their input with SP, the two row-parallel ones sum their
// output (reduce-scatter with SP, all-reduce without); backward mirrors them; the replicated
// gk_proj.0 and head norm weights' partial gradients are all-reduced, and with SP the two norms'.
// `op` gathers the recomputed norm outputs again (SP), `full` runs the whole forward again. The
// embedding and the head are replicated: with SP the head gathers its normed rows, the embedding
// gathers dy, and the final norm's gradient is summed.
uint64_t tp_bytes_per_micro_batch(const GlaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs) {
  const GlaConfig& c = m.config();
  const TpOptions& tp = m.tp();
  const int n = tp.size();
  if (n == 1) return 0;
  auto ar = [n](uint64_t bytes) { return 2 * uint64_t(n - 1) * bytes / uint64_t(n); };
  const RunBlocks rb = run_blocks(m, runs);
  const uint64_t M = uint64_t(B * T), d = uint64_t(c.hidden_size), L = rb.blocks;
  const uint64_t cs = dtype_size(m.compute_dtype()), k = uint64_t(n - 1);
  const uint64_t replicated = ar(uint64_t(c.gate_low_rank_dim) * d * 4) +
                              (c.elementwise_affine ? ar(uint64_t(c.head_v_dim()) * 4) : 0);
  const uint64_t recomputed = rb.recomputed;
  if (!tp.sequence_parallel)
    return (ar(M * d * 4) * 4 + replicated) * L + recomputed * 2 * ar(M * d * 4);
  const uint64_t rows = M / uint64_t(n) * d;  // one rank's block of a [M, d] tensor
  const uint64_t ag_x = k * rows * cs, f32 = k * rows * 4;
  const uint64_t forward = 2 * ag_x + 2 * f32;
  const uint64_t backward = 2 * f32 + 2 * f32 + 2 * ar(d * 4) + replicated;
  const uint64_t op =
      m.activation_checkpoint().mode == ActivationCheckpoint::Mode::op ? 2 * ag_x : 0;
  return (forward + backward + op) * L + recomputed * forward  // blocks
         + (rb.head ? ag_x + ar(d * 4) : 0)                    // head
         + (rb.embed ? f32 : 0);                               // embedding backward
}

// The state passing (parallel/layers/gla_state_passing.cpp), per block: forward all-gathers the
// two segments' total decays [B, Hkv, K] and zero-start states [B, H, K, V], backward the
// segments' D [B, H, K, V]; a recomputed (`full`) block gathers its forward's again. Independent
// of T.
uint64_t cp_bytes_per_micro_batch(const GlaModel& m, int64_t B, int64_t,
                                  const std::vector<bool>& runs) {
  const GlaConfig& c = m.config();
  const int n = m.cp().size();
  if (n <= 1) return 0;
  const int tpn = m.tp().size();
  const uint64_t K = uint64_t(c.head_k_dim()), V = uint64_t(c.head_v_dim());
  const uint64_t state = 2 * uint64_t(B) * uint64_t(c.num_heads / tpn) * K * V * 4;
  const uint64_t decay = 2 * uint64_t(B) * uint64_t(c.num_kv_heads / tpn) * K * 4;
  const RunBlocks rb = run_blocks(m, runs);
  const uint64_t k = uint64_t(n - 1), L = rb.blocks;
  // The short convolution's halo: every segment's last conv_size - 1 rows of q | k | v, gathered
  // in forward, again in backward, and their gradient gathered back.
  const uint64_t halo = c.use_short_conv && c.conv_size > 1
                            ? 2 * uint64_t(B) * uint64_t(c.conv_size - 1) *
                                  uint64_t((c.key_dim() + c.key_dim() / c.kv_groups() +
                                            c.value_dim() / c.kv_groups()) /
                                           tpn) *
                                  4
                            : 0;
  const uint64_t forward = k * (decay + state + halo), backward = k * (state + 2 * halo);
  return L * (forward + backward) + rb.recomputed * forward;
}

// The state passing's fold: every segment's zero-start final state, [2 cp, B, H, K, V], gathered
// in a block's forward and backward.
size_t ring_working_bytes(const GlaModel& m, int64_t B, int64_t) {
  if (m.cp().size() <= 1) return 0;
  const GlaConfig& c = m.config();
  const int n = m.tp().size();
  return 2 * size_t(m.cp().size()) * size_t(B) * size_t(c.num_heads / n) * size_t(c.head_k_dim()) *
         size_t(c.head_v_dim()) * 4;
}

}  // namespace loom::oracle
