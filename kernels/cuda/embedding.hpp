#pragma once
// Token embedding on the device: the counterparts of kernels/cpu/embedding.hpp and of the
// vocabulary-range variants of kernels/cpu/sharded.hpp, with the same arguments and the same
// results. tokens, table, out, dout and dtable are device memory (tokens: n int32); the work is
// queued on the compute stream (kernels/cuda/runtime.hpp).
//
// A token outside the vocabulary is never used as an index: the kernels record the first such
// position and its token in a small device buffer, a deferred check (runtime.hpp's defer_check):
// the host's next wait for the stream (a step's loss read at the latest, before any optimizer
// step) throws the CPU's loom::Error naming the token id and its position. None of these calls
// waits for the stream. (Model::micro_batch checks the tokens on the host before they are
// copied to the device, so in training this check is the kernels' own guard.)
#include <cstdint>

namespace loom::cuda {

// out[i, :] = table[tokens[i], :] for i < n (table [vocab, dim], out [n, dim]). The next wait
// throws naming the first token outside [0, vocab) and its position; the other rows are copied
// and that token's row of out is left as it was.
void embedding_forward(const int32_t* tokens, int64_t n, const float* table, int64_t vocab,
                       int64_t dim, float* out);

// dtable[tokens[i], :] += dout[i, :] (accumulates). Deterministic, with the CPU's bits: the
// (token, position) pairs are sorted by token with a stable radix sort (CUB), so each token's
// positions stay in ascending order, and one block per token and column slice adds that token's
// rows to what dtable held, one after the other in position order: the serial loop's additions
// in its order. A token outside [0, vocab) is raised as embedding_forward's (at the next wait)
// and gives no gradient. The number of distinct tokens stays on the device (the last kernel's
// blocks take the runs in turn). Scratch (about 7n ints and CUB's) from the caching allocator.
void embedding_backward(const int32_t* tokens, int64_t n, const float* dout, int64_t vocab,
                        int64_t dim, float* dtable);

// The rows of vocabulary range [v0, v0 + vocab) of a table split by rows across ranks:
// out[i, :] = table[tokens[i] - v0, :] when the token is in the range, else zeros. Never throws
// for a token (another rank holds it); does not wait for the stream.
void embedding_forward_range(const int32_t* tokens, int64_t n, const float* table, int64_t v0,
                             int64_t vocab, int64_t dim, float* out);
// dtable[tokens[i] - v0, :] += dout[i, :] for the tokens in the range, in position order per
// table row (the CPU's serial bits), as embedding_backward; tokens outside the range give no
// gradient. Does not wait for the stream.
void embedding_backward_range(const int32_t* tokens, int64_t n, const float* dout, int64_t v0,
                              int64_t vocab, int64_t dim, float* dtable);

}  // namespace loom::cuda
