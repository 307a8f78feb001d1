#pragma once
// Mixture-of-experts kernels on the device: the counterparts of kernels/cpu/moe.hpp, with the same
// arguments, layouts and results (read that header for each kernel's contract). Pointers are
// device memory; the work is queued on the compute stream (kernels/cuda/runtime.hpp) and nothing
// waits for it, except moe_permute, whose counts come back to the host.
//
// Numerics, as the CPU's: the router's exp is e^x in double rounded to f32 (glibc's expf agrees
// but for rare midpoints), its other sums and divisions the CPU's, in its order (IEEE operations,
// written out so that nvcc fuses nothing), so the probabilities match the CPU's to the last bit
// almost everywhere and the rest of the router follows them bit for bit; the gathers, the
// dispatch's backward and the combine have the CPU's bits (each product rounded, then added, in
// choice order); the dot products of moe_combine_backward and the router's prob_sum are summed in
// double in a fixed order (a warp's butterfly, fixed row ranges), within a rounding of the CPU's
// f32 result. No atomics where the order could change a value: every output element is written by
// one thread in an order set by the shapes alone, so the bits are the same on every run (the one
// atomic, moe_permute's record of the first bad expert index, is a minimum: the same in any
// order).
//
// Indices. moe_permute checks the expert indices (its counts come back anyway) and throws the
// CPU's loom::Error before writing pos. The other kernels never read or write through an index
// outside its range, but do not wait to throw (a wait per call would stall the stream): the row
// that index would produce is NaN instead (dx, y, dlogits rows; a NaN dweight), which a training
// step's loss then shows. Their indices come from moe_route and moe_permute in the same step.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cuda {

// cpu::moe_route. One thread per token, the CPU's serial loops (so its order): the softmax, then
// the top-k and weights (two kernels); probs may be logits. prob_sum [E] (or nullptr) += the
// column sums of probs, as bias_grad's (kernels/cuda/bias_gate.hpp).
void moe_route(const float* logits, const float* bias, int64_t M, int64_t E, int64_t k,
               bool renormalize, float* probs, int32_t* experts, float* weights, float* prob_sum);
// cpu::moe_route_backward, one thread per token; dlogits may be probs. A token with an expert
// index outside [0, E) gets a NaN row.
void moe_route_backward(const float* probs, const int32_t* experts, const float* weights,
                        const float* dweights, int64_t M, int64_t E, int64_t k, bool renormalize,
                        const float* dprob, float* dlogits);

// cpu::moe_permute_per_expert (and cpu::moe_permute, a capacity for every expert): capacity [E]
// host memory (each >= 0; nullptr: keep every row), copied to the device with the call; counts
// [E] host memory, pos [M*k] device. The stable order without a sort: the assignments in chunks
// of consecutive ones, each chunk's per-expert counts (one warp walking the chunk 32 assignments
// at a time), their exclusive sums per expert over the chunks and the experts' starts (one
// block), then each assignment's rank among its expert's = its chunk's offset + the earlier ones
// of the chunk (the warp's walk again). Waits for the stream once (the E counts and the check
// come back: one device-to-host copy of E + 1 integers).
int64_t moe_permute_per_expert(const int32_t* experts, int64_t M, int64_t k, int64_t E,
                               const int64_t* capacity, int64_t* counts, int32_t* pos);
// cpu::moe_permute_order: order[pos[a]] = a for every kept a (pos in [-1, N): moe_permute's, one
// to one onto [0, N) by construction; a row outside [0, N) is skipped, never written).
void moe_permute_order(const int32_t* pos, int64_t n, int64_t N, int32_t* order);

// cpu::moe_dispatch (a row copy: the bits; 16-byte accesses where rows allow). A row whose order
// index is outside [0, M*k) is NaN.
void moe_dispatch(const float* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  float* xs);
void moe_dispatch(const bf16* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  bf16* xs);
// cpu::moe_dispatch_backward, the CPU's bits (sums in j order, from 0 without accumulate).
void moe_dispatch_backward(const float* dxs, int64_t N, const int32_t* pos, int64_t M, int64_t k,
                           int64_t d, float* dx, bool accumulate);

// cpu::moe_combine, the CPU's bits: y + w0 ys0 + w1 ys1 + ..., each product rounded, then added.
void moe_combine(const float* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y);
void moe_combine(const bf16* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y);
// cpu::moe_combine_backward: one warp per assignment (dys's row the CPU's bits, dweights the dot
// in double, a fixed order).
void moe_combine_backward(const float* dy, const float* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, float* dys,
                          float* dweights);
void moe_combine_backward(const float* dy, const bf16* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, float* dys,
                          float* dweights);
void moe_combine_backward(const float* dy, const float* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, bf16* dys,
                          float* dweights);
void moe_combine_backward(const float* dy, const bf16* ys, int64_t N, const float* weights,
                          const int32_t* pos, int64_t M, int64_t k, int64_t d, bf16* dys,
                          float* dweights);

}  // namespace loom::cuda
