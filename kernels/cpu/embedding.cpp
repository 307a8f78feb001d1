#include "kernels/cpu/embedding.hpp"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

// Compiled once per CPU tier (cpu_isa.hpp); the public functions below dispatch to the tier in use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/embedding.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {

void embedding_backward_impl(const int32_t* tokens, int64_t n, const float* dout, int64_t dim,
                             float* dtable) {
  // Each thread owns a slice of the columns of every row and walks all positions in order, so each
  // table element receives its contributions in position order: the serial loop's bits for any
  // thread count, with no atomics, no sort, and an even split however skewed the token counts.
  // Slices are multiples of 16 floats: with 64-byte aligned rows, threads never share a line.
#pragma omp parallel if (n * dim >= (int64_t{1} << 15))
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((dim + threads - 1) / threads + 15) / 16 * 16;
    const int64_t lo = std::min(dim, t * per), hi = std::min(dim, lo + per);
    for (int64_t i = 0; lo < hi && i < n; ++i) {
      float* __restrict row = dtable + int64_t{tokens[i]} * dim;
      const float* __restrict src = dout + i * dim;
#pragma omp simd
      for (int64_t d = lo; d < hi; ++d) row[d] += src[d];
    }
  }
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
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

HWY_EXPORT(embedding_backward_impl);

void embedding_backward(const int32_t* tokens, int64_t n, const float* dout, int64_t vocab,
                        int64_t dim, float* dtable) {
  check_args("embedding_backward", tokens, n, vocab, dim);
  LOOM_DISPATCH(embedding_backward_impl)(tokens, n, dout, dim, dtable);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
