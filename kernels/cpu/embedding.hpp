#pragma once
#include <cstdint>

namespace loom::cpu {

// out[i, :] = table[tokens[i], :]. Throws loom::Error naming the token if out of [0, vocab).
void embedding_forward(const int32_t* tokens, int64_t n, const float* table, int64_t vocab,
                       int64_t dim, float* out);
// dtable[tokens[i], :] += dout[i, :] (accumulates; deterministic: same result for any thread
// count).
void embedding_backward(const int32_t* tokens, int64_t n, const float* dout, int64_t vocab,
                        int64_t dim, float* dtable);

}  // namespace loom::cpu
