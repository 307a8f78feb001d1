#pragma once
// The output projection fused with cross-entropy on the device, and the per-row pieces of the
// vocabulary-parallel loss: the counterparts of kernels/cpu/cross_entropy.hpp and of
// vocab_shard_lse / vocab_shard_combine / vocab_shard_dlogits (kernels/cpu/sharded.hpp), with the
// same arguments and the same math. Every pointer (x, w, targets, dx, dw, logits, ...) is device
// memory; the work is queued on the compute stream (kernels/cuda/runtime.hpp) and the host never
// waits for it, except where a function says so. A loss is written to a device double, which the
// caller reads once per step.
//
// Rows are independent: one block per row, fp32 logits, 16-byte loads. The loss is summed
// deterministically: each row's loss (a double) is written to its own slot, then one block sums
// the slots in a fixed order that depends on the row count alone, so the same inputs give the
// same bits on every run and every GPU. The GEMMs run through cuda::gemm (cuBLASLt, exact f32 for
// f32 operands unless set_allow_tf32(true)). Results may differ from the CPU's in the last bits:
// CUDA's expf/logf, another summation order, and a row's max and sum of exponentials found in one
// pass (an online rescaling) where the CPU takes two.
#include <cstddef>
#include <cstdint>

#include "core/dtype.hpp"
#include "kernels/cpu/cross_entropy.hpp"  // LinearCrossEntropyArgs, LinearCrossEntropyChunks

namespace loom::cuda {

using cpu::LinearCrossEntropyArgs;
using cpu::LinearCrossEntropyChunks;

// ---- out-of-range targets
//
// A target >= V is never used as an index. Where the caller passes a record (one uint64_t of
// device memory), the first such row is written there and nothing waits: the record holds
// kNoBadTarget, or the row (high 32 bits) and its target (low 32 bits); of several, the smallest
// row is kept (atomicMin), across all the calls since the record was cleared. The caller clears
// it (clear_bad_target, queued) before its first call, and checks it when it reads the loss
// (check_bad_target, or bad_target_error on a value it copied back itself together with the
// loss). A call that finds a bad target still runs to the end: that row gets a zero gradient, as
// an ignored row, and a NaN loss (so the summed loss is NaN even if nobody checks); the step's
// dx, dw and loss must then be thrown away.
inline constexpr uint64_t kNoBadTarget = ~uint64_t{0};
// *record = kNoBadTarget (queued on the stream).
void clear_bad_target(uint64_t* record);
// Throws the CPU's loom::Error ("linear_cross_entropy: target T of row R is out of range for a
// vocabulary of V ...") for a record's value copied to the host; does nothing for kNoBadTarget.
void bad_target_error(uint64_t value, int64_t V);
// Copies the record back (waits for the stream), then bad_target_error.
void check_bad_target(const uint64_t* record, int64_t V);

// ---- the fused loss

// The rows of one chunk of f32 logits and of one group of bf16 logit gradients (the CPU's
// contract: chunk_rows > 0 is taken as it is, 0 picks the chunk; grad_rows is rounded down to a
// multiple of the chunk, and 0 or anything <= the chunk is one chunk's). The automatic chunk is
// the rows whose f32 logits take 256 MiB (a multiple of 64 rows where that is at least 64): at
// V 128256 that is 512 rows (the dW GEMM's inner dimension, so that re-reading the f32 dW once
// per chunk stays a fraction of its time), at V 32000 2048 rows. Pass grad_rows as
// linear_cross_entropy will see it: only bf16 with gradients gathers (the caller passes 0
// otherwise, as linear_cross_entropy does).
LinearCrossEntropyChunks linear_cross_entropy_chunks(int64_t N, int64_t V, int64_t chunk_rows,
                                                     int64_t grad_rows);
// The bytes of the one scratch block a call takes from the caching allocator (booked as
// MemoryUse::loss), for the planner: one chunk of f32 logits [rows, V], the bf16 logit gradients
// [grad_rows, V] (bf16 with gradients only), N per-row losses (doubles) and the record of a call
// that checks its own targets, each at a 256-byte offset. `grad`: dx or dw is computed.
// chunk_rows and grad_rows as in LinearCrossEntropyArgs. 0 for N == 0 (no scratch).
size_t linear_cross_entropy_scratch_bytes(int64_t N, int64_t D, int64_t V, DType ab, bool grad,
                                          int64_t chunk_rows = 0, int64_t grad_rows = 0);

// cpu::linear_cross_entropy on the device, with its semantics: x [N, D] and w [V, D] in dtype
// a.ab (f32 or bf16), targets [N] (< 0: ignored, no loss and a zero gradient row), dx [N, D] f32
// overwritten (nullptr: not computed), dw [V, D] f32 accumulated, or written by the first GEMM
// when a.dw_overwrite (nullptr: not computed). Per chunk of rows: logits = x_c w^T (cuda::gemm,
// f32), then one block per row finds the max, the sum of exp(logit - max) (one pass), the loss
// lse - logit[target] (double(logf(sum)) + (double(max) - double(logit[target])), the CPU's
// expression) and, with gradients, d(loss)/d(logits) * grad_scale = softmax * grad_scale, minus
// grad_scale at the target: in place over the f32 logits (f32), or rounded to bf16
// (f32_to_bf16_bits) into the group's gradient rows (bf16, as the CPU rounds: each element's f32
// value, the target's after its subtraction); then dx_g = dlogits w and dw (+)= dlogits^T x_g
// per group of grad_rows rows (cuda::gemm, f32 accumulation). N == 0: dw zeroed when
// dw_overwrite, the loss 0.
//
// *loss_out (device memory, one double; nullptr: not written) = the sum over the rows of their
// losses, in double, in a fixed order. Nothing waits for the stream when bad_target is given (see
// above). bad_target == nullptr: the call checks the targets itself, waiting for the stream once
// before it queues any other work, and throws the CPU's error naming the row with nothing written
// (dx, dw and *loss_out as they were, as the CPU leaves them).
//
// No output may overlap an input. Throws (before anything is queued) for the CPU's argument
// errors: dtype, N < 0, D or V <= 0, chunk_rows < 0, null x, w or targets with N > 0.
void linear_cross_entropy(const LinearCrossEntropyArgs& a, double* loss_out, uint64_t* bad_target);
// As linear_cross_entropy with the call's own record checked at the host's next wait (a deferred
// check, runtime.hpp): nothing waits, and a bad target gives the record path's results (that
// row's gradient zero, the loss NaN) until the wait throws the CPU's error naming the row. What
// the CUDA backend calls: the targets were checked on the host where they were made.
void linear_cross_entropy_checked_later(const LinearCrossEntropyArgs& a, double* loss_out);

// ---- the vocabulary-parallel loss (the CPU's semantics, sharded.hpp)

// Per row of logits [rows, V] (this rank's columns [v0, v0 + V), the first Vr real): the
// log-sum-exp over the real columns (float(double(max) + log(sum of exp(double(l - max))))), the
// exponentials summed in double; -inf when Vr == 0) and the target's logit when v0 <= target <
// v0 + V (else 0). One block per row.
void vocab_shard_lse(const float* logits, int64_t rows, int64_t V, int64_t Vr,
                     const int32_t* targets, int64_t v0, float* lse, float* target_logit);
// glse[i] = the log-sum-exp of lse_all[r * N + i] over the n ranks (in rank order, as the CPU);
// *loss_out (device memory) = the sum of glse - target_logit over the rows whose target is >= 0,
// in double, in a fixed order. Scratch: N doubles from the caching allocator.
void vocab_shard_combine(const float* lse_all, int n, int64_t N, const int32_t* targets,
                         const float* target_logit, float* glse, double* loss_out);
// logits [rows, V] turned in place into d(loss)/d(logits) * grad_scale: exp(l - glse) *
// grad_scale over the real columns, 0 over the padding, minus grad_scale at the target's column
// (when v0 <= target < v0 + V, padding included as on the CPU); zeros for a row whose target is
// < 0. The same roundings as the CPU's (no fused multiply-add). One block per row.
void vocab_shard_dlogits(float* logits, int64_t rows, int64_t V, int64_t Vr, const int32_t* targets,
                         int64_t v0, const float* glse, float grad_scale);

}  // namespace loom::cuda
