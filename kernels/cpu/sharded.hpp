#pragma once
// The element loops of the sharded layers (parallel/layers): strided row copies (ring attention
// packs K and V into one message), the embedding of one vocabulary range (vocab-parallel), the
// per-row pieces of a softmax over a vocabulary split across ranks, and a fill. Plain loops at
// the baseline ISA: each is memory-bound, and copies and single adds give the same bits on any
// tier.
#include <cstdint>

namespace loom::cpu {

// dst[m, 0:width] = src[m, 0:width] for m < rows; rows `src_stride` / `dst_stride` floats apart.
void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
               int64_t width);

void fill(float* x, int64_t n, float value);

// The rows of vocabulary range [v0, v0 + vocab) of a table split by rows across ranks:
// out[i, :] = table[tokens[i] - v0, :] when the token is in the range, else zeros.
void embedding_forward_range(const int32_t* tokens, int64_t n, const float* table, int64_t v0,
                             int64_t vocab, int64_t dim, float* out);
// dtable[tokens[i] - v0, :] += dout[i, :] for the tokens in the range, serially in token order
// (a token may repeat: the order of the additions is the position order).
void embedding_backward_range(const int32_t* tokens, int64_t n, const float* dout, int64_t v0,
                              int64_t vocab, int64_t dim, float* dtable);

// Softmax cross-entropy over a vocabulary split across ranks; this rank holds logits columns
// [v0, v0 + V), of which the first `Vr` are real (the rest pad the vocabulary to a multiple of the
// rank count and take no part).
//
// Per row of logits [rows, V]: this rank's log-sum-exp over its real columns (-inf when it has
// none) and the target's logit when this rank holds the target (else 0).
void vocab_shard_lse(const float* logits, int64_t rows, int64_t V, int64_t Vr,
                     const int32_t* targets, int64_t v0, float* lse, float* target_logit);
// The row log-sum-exp over every rank, glse[i] from lse_all [n, N]; returns the summed loss
// glse - target_logit over the rows whose target is >= 0 (target_logit summed over ranks).
double vocab_shard_combine(const float* lse_all, int n, int64_t N, const int32_t* targets,
                           const float* target_logit, float* glse);
// logits [rows, V] turned in place into d(loss)/d(logits) * grad_scale: softmax with the global
// log-sum-exp, minus one at the target; zero for padding columns and ignored rows (target < 0).
void vocab_shard_dlogits(float* logits, int64_t rows, int64_t V, int64_t Vr, const int32_t* targets,
                         int64_t v0, const float* glse, float grad_scale);

}  // namespace loom::cpu
