#include "kernels/cpu/embedding.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.hpp"

namespace loom::cpu {

namespace {

// Validates everything up front: an exception must not leave an OpenMP region.
void check_args(const char* what, const int32_t* tokens, int64_t n, int64_t vocab, int64_t dim) {
  LOOM_CHECK(n >= 0, what, ": token count must be >= 0, got ", n);
  LOOM_CHECK(vocab > 0 && vocab <= (int64_t{1} << 31), what,
             ": vocab size must be in [1, 2^31], got ", vocab);
  LOOM_CHECK(dim > 0, what, ": embedding dim must be > 0, got ", dim);
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      fail(what, ": token id ", tokens[i], " at position ", i, " is out of range [0, ", vocab,
           ") (vocab size ", vocab, ")");
    }
  }
}

}  // namespace

void embedding_forward(const int32_t* tokens, int64_t n, const float* table, int64_t vocab,
                       int64_t dim, float* out) {
  check_args("embedding_forward", tokens, n, vocab, dim);
#pragma omp parallel for schedule(static) if (n * dim >= (int64_t{1} << 15))
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out + i * dim, table + int64_t{tokens[i]} * dim, size_t(dim) * sizeof(float));
  }
}

void embedding_backward(const int32_t* tokens, int64_t n, const float* dout, int64_t vocab,
                        int64_t dim, float* dtable) {
  check_args("embedding_backward", tokens, n, vocab, dim);
  LOOM_CHECK(n < (int64_t{1} << 32), "embedding_backward: token count must be < 2^32, got ", n);
  if (n == 0) return;
  // Sort positions by (token, position): each table row then belongs to exactly one thread and
  // receives its contributions in position order, so the sums are the serial loop's bits for any
  // thread count and schedule, with no atomics. Costs O(n log n) on n ints, independent of vocab.
  std::vector<uint64_t> key(n);
  for (int64_t i = 0; i < n; ++i) key[i] = (uint64_t(uint32_t(tokens[i])) << 32) | uint64_t(i);
  std::sort(key.begin(), key.end());
  // Runs of equal tokens: run r covers key[start[r], start[r + 1]).
  std::vector<int64_t> start;
  start.reserve(n + 1);
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || (key[i] >> 32) != (key[i - 1] >> 32)) start.push_back(i);
  }
  start.push_back(n);
  const int64_t runs = int64_t(start.size()) - 1;
  // Frequent tokens make runs uneven; dynamic scheduling balances them.
#pragma omp parallel for schedule(dynamic, 8) if (n * dim >= (int64_t{1} << 15))
  for (int64_t r = 0; r < runs; ++r) {
    float* __restrict row = dtable + int64_t(key[start[r]] >> 32) * dim;
    for (int64_t k = start[r]; k < start[r + 1]; ++k) {
      const float* __restrict src = dout + int64_t(key[k] & 0xffffffffu) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] += src[d];
    }
  }
}

}  // namespace loom::cpu
