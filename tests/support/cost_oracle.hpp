#pragma once
// The cost oracle (a test utility, not part of the product): the memory one rank needs and the
// bytes it sends per step, for a model as parallelize() builds it, derived by hand. The product's
// figures are its step run on the meta device (train/rank_plan.hpp: the pre-flight, `loom bench
// step --check` and `loom plan`); tests/plan/cost_oracle_test.cpp checks that run against these
// independent derivations (docs/design.md "The memory truth and its oracle"), so a change of what
// the step allocates or sends that nobody reasoned about shows up as a difference.
//
// The units' sizes come from the model itself (shards, padding, gathered buffers), so the model
// may be the real one or one built on the meta device (ParallelizeOptions::device): the same
// constructor, hence the same sizes as the allocation. The activations and the tp and cp layers'
// bytes are the families' formulas (tests/support/model_cost.hpp).
//
// Memory of one rank (FSDP: shards of S = ceil(numel / N) elements per unit, N = dp_shard x cp):
//   4 S (f32 master) + 4 S (f32 gradient) + 8 S (AdamW moments), summed over units
//   (+ 2 S for the bf16 mirror of unsharded units)
//   + the full weights alive at the peak, the start of the head's backward: the head, the last
//     block (kept by `default` and `never`, prefetched by `always`), every unit the policy keeps
//     after forward (`never`: all; the tied embedding), each as ParamUnit's gathered buffer
//   + the head's full f32 gradient (and the tied embedding's)
//   + the saved activations of the local batch at their peak, by the [activation_checkpoint]
//     policy (saved_activation_bytes)
//   + the head's working buffers at that moment (x, xf, dxf, rstd, the loss's chunk of logits)
//   or, with FSDP, the last block's backward where that is larger: its gathered weights and full
//   f32 gradient, the prefetched gather of the unit below, the units kept gathered, the tied
//   embedding's full gradient, the head's gradient still being reduce-scattered (input and
//   output shard, priced in f32), with the activations at their peak within the blocks' backward
//   (backward_peak_bytes); not with cp, whose ring is priced with the head's figures
//   + with tp, the pooled communication buffers (tp_comm_buffer_bytes)
//   + with cp, ring attention's working set in a block's backward (ring_working_bytes): the peak
//     moves into the last block's backward, where what it frees (the head's workspace and
//     gradient, its own MLP activations) and what it adds besides the ring (its gradient, dqkv,
//     dattn) about cancel (measured within 1.5% on bench-tiny cp 2, p2p and allgather, with and
//     without full checkpointing).
// CPU offload (ShardLayout::offload): the 16 S bytes of each sharded unit are in host memory
// (`host`), not the device's.
// DDP and one process: 16 bytes per parameter (+ 2 for the bf16 mirror) + activations + head.
// Under pp the states count only the units the rank uses (Model::uses; the others are on
// Device::elsewhere), and FSDP's gathered weights and full gradients too. The activations are the
// rank's peak over the schedule (pp::MemoryModel through the simulator): per stage what a
// micro-batch holds of its units (unit_activation_bytes: saved, zero bubble's deferred
// weight-gradient operands, the backward's working buffers, the head's workspace on the head's
// rank only), and the message buffers (receives posted one action ahead, sends held until they
// complete); no separate head.
//
// Bytes (ProcessGroup's ring convention), per micro-batch and unit: an all-gather
// (N - 1) x S x gather size in forward (+ the bf16 side buffer's all-reduce), the same again in
// backward for the units released after forward, and a reduce-scatter (N - 1) x S x reduce size;
// per step: HSDP's all-reduce of each gradient shard over dp_replicate, the gradient norm's
// all-gather of 8 bytes over dp_shard (x cp) and over tp, and the loss's all-gather of 8 bytes
// over dp. DDP: one all-reduce of each unit's gradient per step plus the loss's all-gather. Per
// micro-batch, tp's collectives (tp_bytes_per_micro_batch) and context parallelism's ring
// attention K/V and dK/dV transfers (cp_bytes_per_micro_batch), under pp for the rank's stages'
// units only, and the 8-byte sum of the loss over cp (under pp once a step). Under pp x FSDP the
// gathers and reduce-scatters follow the rank's action list (pp_fsdp_counts).
#include <cstddef>
#include <cstdint>

#include "parallel/parallelize.hpp"
#include "tests/support/model_cost.hpp"

namespace loom::oracle {

struct MemoryCost {
  size_t num_params = 0;  // this rank's parameters (its tp slices, unsharded)
  size_t params = 0, grads = 0, optimizer = 0, mirror = 0;  // shards (or whole units)
  size_t gathered = 0, full_grad = 0;  // FSDP: full units at the peak (reduce-scatters in flight)
  size_t activations = 0, head = 0;    // one micro-batch's; pp: the rank's peak (head in it)
  size_t comm = 0, ring = 0;           // tp pool, ring attention
  size_t rounding = 0;  // the allocator's rounding of the states' buffers (Allocator::round_size)
  // CPU offload: the offloaded units' master, gradient and moment shards (rounded) are in host
  // memory, here and not in params / grads / optimizer / rounding, nor in total().
  size_t host = 0;
  size_t states() const { return params + grads + optimizer + mirror; }
  size_t total() const {
    return states() + gathered + full_grad + activations + head + comm + ring + rounding;
  }
};

// The memory of one rank of `m` training micro-batches of B samples of T tokens each (the
// global seq_len; with cp a rank holds T / cp of them).
MemoryCost memory_cost(ParallelModel& m, int64_t B, int64_t T);

// Bytes one rank of `m` sends per step of G micro-batches (reduce: the gradients' dtype).
uint64_t bytes_per_step(ParallelModel& m, DType reduce, int64_t B, int64_t T, int64_t G);

}  // namespace loom::oracle
