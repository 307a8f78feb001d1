// The column- and row-parallel linear layers (parallel/layers/tensor_parallel.hpp) over 2 ranks
// of the thread process group (tests/support/), against the same layers without tp: an MLP-like
// pair y = residual + (x W1^T) W2^T, forward and backward, with sequence parallelism (sync and
// async all-gather) and without. Inputs are small integers, so every product and sum is exact in
// f32 and the ranks' results must equal the single rank's to the bit, however the sums split.
#include <gtest/gtest.h>

#include <vector>

#include "distributed/buffer_pool.hpp"
#include "parallel/layers/tensor_parallel.hpp"
#include "tests/support/thread_process_group.hpp"

namespace loom {
namespace {

constexpr int kTp = 2;
constexpr int64_t M = 8, d = 6, N = 4;  // rows, model width, hidden width

// [rows, cols] of small integers from a seed (exact in f32, and so are their products' sums).
Tensor ints(int64_t rows, int64_t cols, int seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::f32);
  for (int64_t i = 0; i < rows * cols; ++i) t.data<float>()[i] = float((i * 7 + seed * 3) % 5 - 2);
  return t;
}

// Columns [c0, c0 + n) of a [rows, cols] tensor, as a new contiguous tensor.
Tensor columns(const Tensor& t, int64_t c0, int64_t n) {
  Tensor out = Tensor::empty({t.size(0), n}, DType::f32);
  for (int64_t i = 0; i < t.size(0); ++i)
    for (int64_t j = 0; j < n; ++j)
      out.data<float>()[i * n + j] = t.data<float>()[i * t.size(1) + c0 + j];
  return out;
}

Tensor rows(const Tensor& t, int64_t r0, int64_t n) {
  Tensor out = Tensor::empty({n, t.size(1)}, DType::f32);
  out.copy_from(t.narrow(0, r0, n));
  return out;
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

struct Result {
  Tensor y, dx, dw1, dw2;  // y and dx: the rank's rows (every row without SP)
};

// Forward and backward of the pair on this rank's slices: W1's rows and W2's columns of the
// rank's hidden units; x, residual and dy the rank's rows with SP.
Result run_pair(const TpRuntime& tp, const Tensor& x, const Tensor& w1, const Tensor& w2,
                const Tensor& residual, const Tensor& dy) {
  Result r;
  Tensor saved, h = Tensor::empty({M, w1.size(0)}, DType::f32);
  column_parallel_forward(tp, x, w1, /*keep_gathered=*/true, saved, h);
  r.y = row_parallel_forward(tp, h, w2, residual);
  r.dw1 = Tensor::zeros(w1.shape(), DType::f32);
  r.dw2 = Tensor::zeros(w2.shape(), DType::f32);
  Tensor dh = Tensor::empty(h.shape(), DType::f32);
  row_parallel_backward(tp, dy, h, w2, r.dw2, dh, DType::f32);
  r.dx = column_parallel_backward(tp, dh, saved, w1, r.dw1);
  r.dx = rows(r.dx, 0, r.dx.size(0));  // out of the pool, which the next call reuses
  return r;
}

struct Mode {
  bool sp, async;
};

class TensorParallel : public ::testing::TestWithParam<Mode> {};

TEST_P(TensorParallel, TwoThreadRanksEqualOneRank) {
  const Mode mode = GetParam();
  const Tensor x = ints(M, d, 1), w1 = ints(N, d, 2), w2 = ints(d, N, 3);
  const Tensor residual = ints(M, d, 4), dy = ints(M, d, 5);
  dist::BufferPool pool;
  const Result one = run_pair(TpRuntime{TpOptions{}, &pool}, x, w1, w2, residual, dy);

  std::vector<Result> got(kTp);
  test::run_ranks(kTp, [&](test::ThreadProcessGroup& g) {
    TpOptions opt;
    opt.group = &g;
    opt.sequence_parallel = mode.sp;
    opt.async = mode.async;
    dist::BufferPool rank_pool;
    // With SP the rank's rows of x, the residual and dy; without, every row.
    const int64_t r = g.rank(), m = mode.sp ? M / kTp : M, r0 = mode.sp ? r * m : 0, h = N / kTp;
    got[size_t(r)] = run_pair(TpRuntime{opt, &rank_pool}, rows(x, r0, m), rows(w1, r * h, h),
                              columns(w2, r * h, h), rows(residual, r0, m), rows(dy, r0, m));
  });
  for (int64_t r = 0; r < kTp; ++r) {
    const Result& mine = got[size_t(r)];
    const int64_t m = mode.sp ? M / kTp : M, r0 = mode.sp ? r * m : 0, h = N / kTp;
    EXPECT_EQ(values(mine.y), values(rows(one.y, r0, m))) << "rank " << r;
    EXPECT_EQ(values(mine.dx), values(rows(one.dx, r0, m))) << "rank " << r;
    EXPECT_EQ(values(mine.dw1), values(rows(one.dw1, r * h, h))) << "rank " << r;
    EXPECT_EQ(values(mine.dw2), values(columns(one.dw2, r * h, h))) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TensorParallel,
                         ::testing::Values(Mode{true, false}, Mode{true, true}, Mode{false, false}),
                         [](const auto& info) {
                           return std::string(info.param.sp ? "sp" : "no_sp") +
                                  (info.param.async ? "_async" : "");
                         });

}  // namespace
}  // namespace loom
