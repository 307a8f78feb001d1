// The cuBLASLt GEMM against the CPU GEMM (kernels/cpu/gemm.hpp, the same GemmArgs): every
// transpose, padded leading dimensions, accumulate, the rounded bf16 output and the residual
// form, f32 (exact, TF32 off) and bf16, odd shapes and Llama shapes. The column-major mapping and
// the argument checks are host-side and run without a GPU.
#include "kernels/cuda/gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

namespace loom::cuda {
namespace {

using test::randn;

TEST(CudaGemmHost, ColumnMajorProblemOfEachTranspose) {
  GemmArgs a;
  a.M = 5, a.N = 7, a.K = 3;
  a.lda = 3, a.ldb = 7, a.ldc = 9;
  LtProblem p = lt_problem(a);  // C^T [7, 5] = B^T [7, 3] A^T [3, 5]
  EXPECT_FALSE(p.trans_a);
  EXPECT_FALSE(p.trans_b);
  EXPECT_EQ(p.a_rows, 7u);
  EXPECT_EQ(p.a_cols, 3u);
  EXPECT_EQ(p.lda, 7);
  EXPECT_EQ(p.b_rows, 3u);
  EXPECT_EQ(p.b_cols, 5u);
  EXPECT_EQ(p.ldb, 3);
  EXPECT_EQ(p.c_rows, 7u);
  EXPECT_EQ(p.c_cols, 5u);
  EXPECT_EQ(p.ldc, 9);
  a.ta = Trans::T, a.tb = Trans::T;  // A stored [3, 5], B stored [7, 3]
  a.lda = 6, a.ldb = 4;
  p = lt_problem(a);
  EXPECT_TRUE(p.trans_a);
  EXPECT_TRUE(p.trans_b);
  EXPECT_EQ(p.a_rows, 3u);  // B's buffer column-major: [3, 7]
  EXPECT_EQ(p.a_cols, 7u);
  EXPECT_EQ(p.lda, 4);
  EXPECT_EQ(p.b_rows, 5u);  // A's buffer column-major: [5, 3]
  EXPECT_EQ(p.b_cols, 3u);
  EXPECT_EQ(p.ldb, 6);
}

TEST(CudaGemmHost, PointerAlignment) {
  alignas(16) static char buf[64];
  EXPECT_EQ(pointer_alignment(buf), 16u);
  EXPECT_EQ(pointer_alignment(buf + 2), 2u);
  EXPECT_EQ(pointer_alignment(buf + 4), 4u);
  EXPECT_EQ(pointer_alignment(buf + 8), 8u);
  EXPECT_EQ(pointer_alignment(buf + 1), 1u);
  EXPECT_EQ(pointer_alignment(buf + 48), 16u);
}

TEST(CudaGemmHost, BadArgumentsThrowNamingThem) {
  float c = 0;
  GemmArgs a;
  a.M = 2, a.N = 3, a.K = 4;
  a.lda = 3, a.ldb = 3, a.ldc = 3;  // lda < K
  a.C = &c;
  try {
    cpu::check_gemm_args(a);
    FAIL() << "lda below the width of A was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lda=3"), std::string::npos) << e.what();
  }
  a.lda = 4;
  a.accumulate = true;
  a.C16 = reinterpret_cast<bf16*>(&c);
  a.C = nullptr;
  EXPECT_THROW(cpu::check_gemm_args(a), Error);
}

struct Case {
  Trans ta, tb;
  int64_t M, N, K;
  int64_t pad = 0;  // added to every leading dimension
};

// Runs one case on both engines and compares C (the whole buffer, padding included: columns past
// N must be left as they were).
void run_case(const Case& cs, DType ab, bool accumulate, bool c16, bool residual, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "M=" << cs.M << " N=" << cs.N << " K=" << cs.K
                                  << " ta=" << (cs.ta == Trans::T) << " tb=" << (cs.tb == Trans::T)
                                  << " pad=" << cs.pad << " " << dtype_name(ab)
                                  << (accumulate ? " accumulate" : "") << (c16 ? " C16" : "")
                                  << (residual ? " R" : ""));
  const bool ta = cs.ta == Trans::T, tb = cs.tb == Trans::T;
  const int64_t lda = (ta ? cs.M : cs.K) + cs.pad, ldb = (tb ? cs.K : cs.N) + cs.pad,
                ldc = cs.N + cs.pad;
  const int64_t rows_a = ta ? cs.K : cs.M, rows_b = tb ? cs.N : cs.K;
  std::vector<float> a = randn(size_t(rows_a * lda), seed),
                     b = randn(size_t(rows_b * ldb), seed + 1),
                     c0 = randn(size_t(cs.M * ldc), seed + 2),
                     r = randn(size_t(cs.M * ldc), seed + 3);
  // The CPU engine on the same (rounded) inputs.
  Tensor ha = test::to_host_tensor(a, ab), hb = test::to_host_tensor(b, ab);
  std::vector<float> want = c0;
  std::vector<bf16> want16(size_t(cs.M * ldc));
  GemmArgs g;
  g.ta = cs.ta, g.tb = cs.tb, g.M = cs.M, g.N = cs.N, g.K = cs.K;
  g.lda = lda, g.ldb = ldb, g.ldc = ldc, g.ab = ab, g.accumulate = accumulate;
  g.A = ha.raw(), g.B = hb.raw();
  if (c16) {
    g.C16 = want16.data();
  } else {
    g.C = want.data();
  }
  if (residual) g.R = r.data(), g.ldr = ldc;
  cpu::gemm(g);

  Tensor da = test::to_device(a, ab), db = test::to_device(b, ab), dr = test::to_device(r);
  Tensor dc =
      c16 ? test::to_device(std::vector<float>(c0.size(), NAN), DType::bf16) : test::to_device(c0);
  if (!c16 && !accumulate && !residual) {
    // Poison the product's elements (not the padding, which must stay c0).
    std::vector<float> poisoned = c0;
    for (int64_t m = 0; m < cs.M; ++m)
      for (int64_t n = 0; n < cs.N; ++n) poisoned[size_t(m * ldc + n)] = NAN;
    dc = test::to_device(poisoned);
  }
  g.A = da.raw(), g.B = db.raw();
  g.C = c16 ? nullptr : dc.data<float>();
  g.C16 = c16 ? dc.data<bf16>() : nullptr;
  g.R = residual ? dr.data<float>() : nullptr;
  cuda::gemm(g);
  const std::vector<float> got = test::to_host(dc);
  // f32: exact float32 products, only the order of the sums differs; bf16 operands: the same
  // products, f32 sums (the order differs); a rounded output may round a near-tie either way.
  const double tol = ab == DType::f32 ? 1e-5 : 1e-5;
  double num = 0, den = 0;
  for (int64_t m = 0; m < cs.M; ++m)
    for (int64_t n = 0; n < ldc; ++n) {
      const size_t i = size_t(m * ldc + n);
      const double w = c16 ? double(bf16_to_float(want16[i])) : double(want[i]);
      if (n >= cs.N) {
        if (!c16) {
          EXPECT_EQ(got[i], c0[i]) << "padding written at " << m << "," << n;
        }
        continue;
      }
      ASSERT_FALSE(std::isnan(got[i])) << "C[" << m << "," << n << "] not written";
      num += (got[i] - w) * (got[i] - w);
      den += w * w;
    }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), c16 ? 4e-3 : tol);
}

class CudaGemm : public test::CudaTest {};

TEST_F(CudaGemm, AllTransposesAndFormsMatchTheCpu) {
  set_allow_tf32(false);
  const std::vector<Case> cases = {
      {Trans::N, Trans::N, 1, 1, 1},       {Trans::N, Trans::T, 37, 29, 45},
      {Trans::T, Trans::N, 64, 33, 17, 3}, {Trans::T, Trans::T, 13, 96, 130, 8},
      {Trans::N, Trans::T, 3, 257, 64, 1}, {Trans::N, Trans::N, 128, 64, 200}};
  uint64_t seed = 10;
  for (const Case& c : cases)
    for (DType ab : {DType::f32, DType::bf16}) {
      run_case(c, ab, false, false, false, seed++);
      run_case(c, ab, true, false, false, seed++);
      run_case(c, ab, false, true, false, seed++);
      run_case(c, ab, false, false, true, seed++);
    }
}

TEST_F(CudaGemm, LlamaShapes) {
  set_allow_tf32(false);
  // Llama 3.2 1B (d 2048, F 8192, kv 512) and Llama 3 8B (d 4096, F 14336) for a few tokens: the
  // forward (x W^T), the input gradient (dy W) and the weight gradient (dy^T x, accumulated).
  const int64_t T = 96;
  uint64_t seed = 100;
  for (auto [d, f] : {std::pair<int64_t, int64_t>{2048, 8192}, {4096, 14336}}) {
    run_case({Trans::N, Trans::T, T, f, d}, DType::bf16, false, false, false, seed++);
    run_case({Trans::N, Trans::N, T, d, f}, DType::bf16, false, false, false, seed++);
    run_case({Trans::T, Trans::N, f, d, T}, DType::bf16, true, false, false, seed++);
    run_case({Trans::N, Trans::T, T, 512, d}, DType::f32, false, false, false, seed++);
  }
}

TEST_F(CudaGemm, EmptyInnerDimensionWritesZerosOrTheResidual) {
  for (bool residual : {false, true})
    run_case({Trans::N, Trans::N, 5, 7, 0, 2}, DType::f32, false, false, residual, 7);
  run_case({Trans::N, Trans::N, 5, 7, 0, 1}, DType::bf16, true, false, false, 8);
}

}  // namespace
}  // namespace loom::cuda
