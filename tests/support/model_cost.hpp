#pragma once
// The cost oracle's formulas per model (a test utility, not part of the product): what one
// micro-batch of B samples of T tokens holds and sends on one rank, derived by hand from what
// each block saves for its backward, its working buffers and its collectives, under the model's
// tp, cp and activation checkpointing. The product measures these by running its step on the meta
// device (train/rank_plan.hpp); tests/plan/cost_oracle_test.cpp checks that run against these
// independent derivations (docs/design.md "The memory truth and its oracle").
//
// Each function taking a Model dispatches on its family (LlamaModel: tests/support/llama_cost.cpp,
// GlaModel: tests/support/gla_cost.cpp); T is this rank's tokens per sample (with cp, seq_len /
// cp). The ring helpers are ring attention's (parallel/layers/context_parallel.hpp).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/gla.hpp"
#include "model/llama.hpp"
#include "model/model.hpp"

namespace loom::oracle {

// Bytes of saved activations at their peak.
size_t saved_activation_bytes(const Model& m, int64_t B, int64_t T);
// Bytes saved when the head's backward starts (its workspace comes on top of these; a peak
// elsewhere does not add it). GLA: its peak.
size_t saved_at_head_bytes(const Model& m, int64_t B, int64_t T);
// The peak within the blocks' backward: what is saved then plus a block's working buffers (FSDP's
// full gradient and gathers of that moment come on top, tests/support/cost_oracle.cpp). GLA: its
// peak.
size_t backward_peak_bytes(const Model& m, int64_t B, int64_t T);
// The head's working buffers at the start of its fused backward.
size_t head_workspace_bytes(const Model& m, int64_t B, int64_t T);
// The pooled communication buffers of tensor parallelism after a step (Model::comm_buffer_bytes):
// one per (purpose, dtype, size) of the tp layers' tp_pooled() calls.
size_t tp_comm_buffer_bytes(const Model& m, int64_t B, int64_t T);
// Bytes this rank sends on the tp group, and on the cp group, in one micro-batch. `runs`: per
// unit (units() order) whether this rank runs its forward and backward (a pp rank: its stages'
// units, not a tied embedding's replica); empty: every unit.
uint64_t tp_bytes_per_micro_batch(const Model& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs = {});
uint64_t cp_bytes_per_micro_batch(const Model& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs = {});
// Context parallelism's working set in a block's backward beyond the saved activations (0
// without cp).
size_t ring_working_bytes(const Model& m, int64_t B, int64_t T);

// What unit i (units() order) holds per micro-batch, for a pipeline stage's share of a rank's
// memory (a stage runs a range of units, and a pp rank holds several micro-batches at once): the
// embedding saves nothing (its output is block 0's input), a block what its checkpointing mode
// keeps, the head its input (its workspace is its backward's). GLA's backward and deferred
// figures are estimates from its GEMMs' operands.
struct UnitActivations {
  size_t saved = 0;           // from its forward to its backward (a block's input included)
  size_t backward = 0;        // working buffers of its backward beyond what it saved
  size_t deferred = 0;        // zero bubble: its linear layers' weight-gradient operands, I to W
  size_t backward_input = 0;  // zero bubble: working buffers of its I (copies pile up there)
  size_t forward = 0;  // working buffers of its forward beyond what it saves (checkpointing's)
};
UnitActivations unit_activation_bytes(const Model& m, size_t unit, int64_t B, int64_t T);

// The families' formulas the dispatch above calls.
size_t saved_activation_bytes(const LlamaModel& m, int64_t B, int64_t T);
size_t saved_at_head_bytes(const LlamaModel& m, int64_t B, int64_t T);
size_t backward_peak_bytes(const LlamaModel& m, int64_t B, int64_t T);
size_t head_workspace_bytes(const LlamaModel& m, int64_t B, int64_t T);
size_t tp_comm_buffer_bytes(const LlamaModel& m, int64_t B, int64_t T);
uint64_t tp_bytes_per_micro_batch(const LlamaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs);
uint64_t cp_bytes_per_micro_batch(const LlamaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs);
size_t ring_working_bytes(const LlamaModel& m, int64_t B, int64_t T);
UnitActivations unit_activation_bytes(const LlamaModel& m, size_t unit, int64_t B, int64_t T);

size_t saved_activation_bytes(const GlaModel& m, int64_t B, int64_t T);
size_t head_workspace_bytes(const GlaModel& m, int64_t B, int64_t T);
size_t tp_comm_buffer_bytes(const GlaModel& m, int64_t B, int64_t T);
uint64_t tp_bytes_per_micro_batch(const GlaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs);
uint64_t cp_bytes_per_micro_batch(const GlaModel& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs);
size_t ring_working_bytes(const GlaModel& m, int64_t B, int64_t T);
UnitActivations unit_activation_bytes(const GlaModel& m, size_t unit, int64_t B, int64_t T);

// Llama's activations of one micro-batch on a config (no model built): without checkpointing
// every block's saved tensors; with it, the larger of what the blocks save and, for the last
// block recomputed in backward, what the blocks before it save plus that block's recomputed
// tensors. With tensor parallelism (tp ranks, sequence parallel, recompute_allgather): one tp
// rank's. In bf16 the peak also holds a block's f32 input beside its rounded copy, and what the
// allocator hands a saved tensor beyond its size when it reuses the block's freed f32 qkv output.
struct LlamaActivations {
  size_t at_head = 0;   // what the blocks have saved when the head runs
  size_t peak = 0;      // their peak (at the head, or in a block's transients or recomputation)
  size_t backward = 0;  // the peak within the blocks' backward
};
LlamaActivations llama_activations(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                   int tp = 1, bool sp = false, bool recompute = false,
                                   const ActivationCheckpoint& ac = {});

// What one GLA block saves for its backward under `mode` (one tp rank's, B*T rows of this rank),
// GlaBlockActs' fields one by one.
size_t gla_block_saved_bytes(const GlaModel& m, int64_t B, int64_t T,
                             ActivationCheckpoint::Mode mode);
// GLA's context parallelism's per-block state (0 without cp).
size_t gla_cp_state_bytes(const GlaModel& m, int64_t B);

// What this rank runs of `runs` (empty: every unit): its blocks, how many of them the model's
// checkpointing recomputes, and whether it runs the embedding and the head.
struct RunBlocks {
  uint64_t blocks = 0, recomputed = 0;
  bool embed = true, head = true;
};
RunBlocks run_blocks(const Model& m, const std::vector<bool>& runs);

// Ring attention (parallel/layers/context_parallel.hpp). One ring K/V block: `rows` tokens of
// `kv_heads` heads of `hd`, K and V, f32.
size_t ring_kv_bytes(int64_t rows, int64_t kv_heads, int64_t hd);
// Bytes this rank sends on the cp group in one micro-batch: the K/V blocks (forward, and again
// for the `recomputed` layers' forward) and dK/dV, over `layers` attention layers.
uint64_t ring_bytes(const CpOptions& cp, size_t kv_bytes, int64_t layers, int64_t recomputed);
// The ring's largest working set in a layer's backward: K/V blocks and dK/dV accumulators (p2p:
// the block in hand, the one arriving, the partial sum, the accumulator arriving and the one
// leaving; allgather: all cp blocks, their dK/dV, this rank's sum) and Di of `rows` x `q_heads`.
size_t ring_working_bytes(const CpOptions& cp, size_t kv_bytes, int64_t rows, int64_t q_heads);

}  // namespace loom::oracle
