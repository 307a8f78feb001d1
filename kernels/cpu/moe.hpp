#pragma once
// Mixture-of-experts kernels (ops/ops.hpp "mixture of experts"): the router's softmax and top-k,
// the grouping of tokens by expert, the gather into and the weighted sum out of the experts' rows.
// Plain scalar C++ (memory-bound, no per-tier code), threaded over tokens with OpenMP. Every
// output element is computed by one thread in a fixed order, so the bits are the same whatever
// the thread count. Index arguments are checked up front (a loom::Error naming the kernel, the
// index and the range), before any output is written.
#include <cstdint>

#include "core/dtype.hpp"

namespace loom::cpu {

// The router of M tokens over E experts choosing k (1 <= k <= E) each.
// probs [M, E] = softmax(logits [M, E]) per row: the row's max subtracted, exp in f32, the exps
// summed in double in expert order, each exp divided by the sum in double and rounded once to f32.
// probs may be logits (in place).
// experts [M, k]: the k largest of probs + bias (bias [E] or nullptr: none), largest first, a tie
// to the lower expert index (k passes of an argmax with a strict >, over the experts not chosen
// yet). weights [M, k] = the chosen probs (never the bias); with `renormalize` each divided by
// their sum (in f32, in choice order). prob_sum [E] (or nullptr): prob_sum[e] += the sum over the
// tokens of probs[t, e], accumulated in double in token order and added once, rounded to f32.
void moe_route(const float* logits, const float* bias, int64_t M, int64_t E, int64_t k,
               bool renormalize, float* probs, int32_t* experts, float* weights, float* prob_sum);

// The gradient of moe_route's weights (dweights [M, k]) and, with dprob [E] (or nullptr), of
// sum_t,e dprob[e] probs[t, e] (the auxiliary loss), through the renormalization and the softmax:
// dlogits [M, E] overwritten; it may be probs (in place). With renormalize, w_i = p_i / s
// (s = the sum of the chosen p, as the forward computed it): dp_i = (dw_i - sum_j dw_j w_j) / s;
// without, dp_i = dw_i; 0 for the experts not chosen; then dp_e += dprob[e]. Softmax:
// dlogit_e = p_e (dp_e - sum_f p_f dp_f), the sum in double in expert order.
void moe_route_backward(const float* probs, const int32_t* experts, const float* weights,
                        const float* dweights, int64_t M, int64_t E, int64_t k, bool renormalize,
                        const float* dprob, float* dlogits);

// The stable counting sort of the M*k assignments a = t*k + j by expert (experts [M*k], each in
// [0, E)): counts [E] the rows each expert keeps, pos [M*k] each assignment's row (-1: dropped),
// rows of expert e after those of experts 0..e-1, each expert's in increasing a (token order).
// capacity > 0 keeps the first `capacity` assignments of each expert, 0 every one. Returns the
// number dropped. Serial (one pass over the assignments to count, one to place).
int64_t moe_permute(const int32_t* experts, int64_t M, int64_t k, int64_t E, int64_t capacity,
                    int64_t* counts, int32_t* pos);
// The same with a capacity per expert: expert e keeps its first capacity[e] (>= 0) assignments;
// capacity nullptr keeps every one. (Context parallelism: the rows a cp rank may keep of each
// expert so that the micro-batch drops what one process would, model/moe_capacity.hpp.)
int64_t moe_permute_per_expert(const int32_t* experts, int64_t M, int64_t k, int64_t E,
                               const int64_t* capacity, int64_t* counts, int32_t* pos);
// order [N] (N = the kept rows) from pos [n]: order[pos[a]] = a for every kept a. pos must map
// the kept assignments one to one onto [0, N) (an error otherwise).
void moe_permute_order(const int32_t* pos, int64_t n, int64_t N, int32_t* order);

// xs [N, d] row i = x [M, d] row order[i] / k (order[i] in [0, M*k)).
void moe_dispatch(const float* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  float* xs);
void moe_dispatch(const bf16* x, int64_t M, int64_t d, const int32_t* order, int64_t N, int64_t k,
                  bf16* xs);
// dx [M, d] row t = (dx[t] +, with accumulate) dxs[pos[t*k]] + dxs[pos[t*k+1]] + ..., left to
// right in j, dropped choices (pos -1) skipped; without accumulate a token with none gets zeros.
// pos in [-1, N).
void moe_dispatch_backward(const float* dxs, int64_t N, const int32_t* pos, int64_t M, int64_t k,
                           int64_t d, float* dx, bool accumulate);

// y [M, d] row t = y[t] + w[t,0] ys[pos[t*k]] + w[t,1] ys[pos[t*k+1]] + ..., each element summed
// left to right in j (the product rounded to f32, then added), dropped choices skipped; ys [N, d]
// f32 or bf16 (widened exactly).
void moe_combine(const float* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y);
void moe_combine(const bf16* ys, int64_t N, const float* weights, const int32_t* pos, int64_t M,
                 int64_t k, int64_t d, float* y);
// For moe_combine: dys [N, d] row pos[t*k+j] = weights[t, j] * dy[t] (f32, or rounded to bf16),
// dweights [M, k] = dy[t] . ys[pos[t*k+j]] (summed in double over d in column order, rounded to
// f32; 0 where dropped). Every row of dys is written (each row is one kept assignment's).
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

}  // namespace loom::cpu
