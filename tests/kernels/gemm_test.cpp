#include "kernels/cpu/gemm.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "tests/test_util.hpp"

namespace loom::cpu {
namespace {

using test::randn;

struct Case {
  Trans ta, tb;
  int64_t M, N, K;
  int64_t pad_a = 0, pad_b = 0, pad_c = 0;  // leading dimension = stored width + pad
};

// Inputs are stored with their leading dimensions; elements in the padding are filled with large
// values so that reading them would show up in the result.
struct Problem {
  Case c;
  int64_t lda, ldb, ldc, rows_a, rows_b;
  std::vector<float> a, b, c0;  // f32 storage (bf16 cases round these first)

  explicit Problem(const Case& cs, uint64_t seed) : c(cs) {
    const bool ta = c.ta == Trans::T, tb = c.tb == Trans::T;
    rows_a = ta ? c.K : c.M;
    rows_b = tb ? c.N : c.K;
    lda = (ta ? c.M : c.K) + c.pad_a;
    ldb = (tb ? c.K : c.N) + c.pad_b;
    ldc = c.N + c.pad_c;
    a = randn(rows_a * lda, seed);
    b = randn(rows_b * ldb, seed + 1);
    c0 = randn(c.M * ldc, seed + 2);
    for (int64_t i = 0; i < rows_a; ++i)
      for (int64_t j = ta ? c.M : c.K; j < lda; ++j) a[i * lda + j] = 1e6f;
    for (int64_t i = 0; i < rows_b; ++i)
      for (int64_t j = tb ? c.K : c.N; j < ldb; ++j) b[i * ldb + j] = 1e6f;
  }
  double A(int64_t m, int64_t k) const {
    return c.ta == Trans::T ? a[k * lda + m] : a[m * lda + k];
  }
  double B(int64_t k, int64_t n) const {
    return c.tb == Trans::T ? b[n * ldb + k] : b[k * ldb + n];
  }
  // Naive double reference of the full C buffer (padding unchanged).
  std::vector<double> reference(bool accumulate) const {
    std::vector<double> r(c0.begin(), c0.end());
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < c.K; ++k) s += A(m, k) * B(k, n);
        r[m * ldc + n] = (accumulate ? r[m * ldc + n] : 0.0) + s;
      }
    return r;
  }
  // Worst-case scale of the rounding error of element (m, n): sum_k |a_mk b_kn| (+ |c|).
  double magnitude(int64_t m, int64_t n, bool accumulate) const {
    double s = accumulate ? std::abs(double(c0[m * ldc + n])) : 0.0;
    for (int64_t k = 0; k < c.K; ++k) s += std::abs(A(m, k) * B(k, n));
    return s;
  }
};

std::vector<bf16> round_to_bf16(std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = float_to_bf16(v[i]);
    v[i] = bf16_to_float(out[i]);  // so the reference sees exactly what the kernel sees
  }
  return out;
}

// The problem's operands in `dt` (bf16: rounded, and the problem's f32 copies with them, so the
// reference sees what the kernel sees) and the GemmArgs that multiply them; C is the caller's.
struct Operands {
  std::vector<bf16> a16, b16;
  GemmArgs args;
  Operands(Problem& p, DType dt) {
    const void *A = p.a.data(), *B = p.b.data();
    if (dt == DType::bf16) {
      a16 = round_to_bf16(p.a);
      b16 = round_to_bf16(p.b);
      A = a16.data();
      B = b16.data();
    }
    args = {.ta = p.c.ta,
            .tb = p.c.tb,
            .M = p.c.M,
            .N = p.c.N,
            .K = p.c.K,
            .A = A,
            .lda = p.lda,
            .B = B,
            .ldb = p.ldb,
            .ldc = p.ldc,
            .ab = dt};
  }
};

// Runs the kernel and checks every element against the fp64 reference: within `tol` of the
// worst-case error scale sum_k |a b| (f32 accumulation over K <= 1000 terms stays well under
// 1e-5 of it; a wrong transpose, stride or a missing accumulate is off by O(1) of it), and the
// padding of C untouched.
void check(const Case& cs, DType dt, bool accumulate, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "M=" << cs.M << " N=" << cs.N << " K=" << cs.K
                                  << " ta=" << int(cs.ta) << " tb=" << int(cs.tb)
                                  << " pads=" << cs.pad_a << "," << cs.pad_b << "," << cs.pad_c
                                  << " dtype=" << dtype_name(dt) << " acc=" << accumulate);
  Problem p(cs, seed);
  Operands ops(p, dt);
  std::vector<float> c = p.c0;
  ops.args.C = c.data();
  ops.args.accumulate = accumulate;
  gemm(ops.args);
  const auto ref = p.reference(accumulate);
  int bad = 0;
  for (int64_t m = 0; m < cs.M; ++m) {
    for (int64_t n = 0; n < p.ldc; ++n) {
      const double got = c[m * p.ldc + n], want = ref[m * p.ldc + n];
      if (n >= cs.N) {
        if (got != want && ++bad < 5) ADD_FAILURE() << "padding of C changed at " << m << "," << n;
        continue;
      }
      const double tol = 1e-5 * p.magnitude(m, n, accumulate) + 1e-30;
      if (std::abs(got - want) > tol && ++bad < 5)
        ADD_FAILURE() << "C[" << m << "," << n << "] = " << got << ", expected " << want;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LT(test::rel_l2(c, ref), 1e-5);
}

const Trans kTrans[] = {Trans::N, Trans::T};

TEST(Gemm, AllTransposesAwkwardSizesF32) {
  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      for (bool acc : {false, true}) {
        check({ta, tb, 37, 29, 53}, DType::f32, acc, 10);
        check({ta, tb, 37, 29, 53, 3, 5, 7}, DType::f32, acc, 20);
      }
}

TEST(Gemm, AllTransposesAwkwardSizesBf16) {
  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      for (bool acc : {false, true}) {
        check({ta, tb, 37, 29, 53}, DType::bf16, acc, 30);
        check({ta, tb, 37, 29, 53, 3, 5, 7}, DType::bf16, acc, 40);
      }
}

// Sizes past oneDNN's blocking (several blocks in every dimension, with remainders).
TEST(Gemm, LargerBlockedSizes) {
  for (DType dt : {DType::f32, DType::bf16})
    for (Trans ta : kTrans)
      for (Trans tb : kTrans) check({ta, tb, 131, 97, 301, 1, 0, 4}, dt, true, 50);
}

TEST(Gemm, DegenerateSizes) {
  for (DType dt : {DType::f32, DType::bf16}) {
    check({Trans::N, Trans::T, 1, 1, 1}, dt, false, 60);
    check({Trans::T, Trans::N, 1, 17, 5}, dt, true, 61);
    check({Trans::N, Trans::N, 13, 1, 300}, dt, false, 62);
  }
  // K = 0 is an empty sum: C is zeroed, or kept when accumulating.
  std::vector<float> c = {1, 2, 3, 4};
  gemm({.M = 2, .N = 2, .K = 0, .lda = 1, .ldb = 2, .C = c.data(), .ldc = 2, .accumulate = true});
  EXPECT_EQ(c, (std::vector<float>{1, 2, 3, 4}));
  gemm({.M = 2, .N = 2, .K = 0, .lda = 1, .ldb = 2, .C = c.data(), .ldc = 2});
  EXPECT_EQ(c, (std::vector<float>{0, 0, 0, 0}));
}

// The primitive cache must tell apart problems that differ only in one key field.
TEST(Gemm, CacheDistinguishesKeys) {
  check({Trans::N, Trans::N, 37, 29, 53}, DType::f32, false, 70);
  check({Trans::N, Trans::N, 37, 29, 53}, DType::f32, true, 71);
  check({Trans::N, Trans::N, 37, 29, 53, 0, 0, 1}, DType::f32, true, 72);
  check({Trans::N, Trans::N, 37, 29, 53}, DType::bf16, true, 73);
  check({Trans::N, Trans::N, 37, 29, 53}, DType::f32, false, 74);
}

// OpenMP's thread count for a test's scope.
struct ScopedThreads {
  explicit ScopedThreads(int n) { omp_set_num_threads(n); }
  ~ScopedThreads() { omp_set_num_threads(saved); }
  int saved = omp_get_max_threads();
};

// Whether gemm splits calls by rows here: where oneDNN runs at AVX-512 or AMX.
bool splits_rows() {
  return cpu_isa().onednn.rfind("avx512", 0) == 0 || cpu_isa().onednn.rfind("amx", 0) == 0;
}

// With rows enough, a call runs as one single-threaded matmul per block of rows of C, the blocks
// uneven where the rows do not divide: every transpose, dtype, accumulate and padding against the
// fp64 reference, at 3 blocks (and 2 in the residual test below), and the rounded bf16 output.
TEST(Gemm, RowBlocksPerThreadMatchTheReference) {
  ScopedThreads threads(3);
  uint64_t seed = 200;
  for (int64_t M : {301, 401}) {
    GemmArgs shape{.M = M, .N = 37, .K = 75, .lda = 75, .ldb = 75, .ldc = 37};
    // 301 rows are too few for three threads (128 each): one matmul on oneDNN's threads.
    ASSERT_EQ(gemm_parts(shape), splits_rows() && M == 401 ? 3 : 1)
        << "M=" << M << ", oneDNN " << cpu_isa().onednn;
    for (DType dt : {DType::f32, DType::bf16})
      for (Trans ta : kTrans)
        for (Trans tb : kTrans)
          for (bool acc : {false, true}) check({ta, tb, M, 37, 75, 2, 1, 3}, dt, acc, ++seed);
  }
  // The rounded output, split: the bf16 rounding of the f32 product (GemmArgs::C16).
  Problem p({Trans::N, Trans::T, 401, 37, 75}, 300);
  Operands ops(p, DType::bf16);
  std::vector<float> c(size_t(401 * p.ldc));
  ops.args.C = c.data();
  gemm(ops.args);
  std::vector<bf16> c16(c.size());
  ops.args.C = nullptr;
  ops.args.C16 = c16.data();
  ASSERT_EQ(gemm_parts(ops.args), splits_rows() ? 3 : 1);
  gemm(ops.args);
  for (size_t i = 0; i < c.size(); ++i)
    ASSERT_EQ(c16[i].bits, float_to_bf16(c[i]).bits) << "element " << i;
  // One thread, or too few rows: one matmul.
  omp_set_num_threads(1);
  EXPECT_EQ(gemm_parts(ops.args), 1);
  omp_set_num_threads(3);
  ops.args.M = 255;
  EXPECT_EQ(gemm_parts(ops.args), 1);
}

// C = R + op(A) op(B): C's prior contents (NaN here) never read, R's padding never read, in one
// matmul and split into row blocks, every transpose and dtype, and the empty sum (C = R).
TEST(Gemm, ResidualIsCopiedIntoC) {
  ScopedThreads threads(2);
  uint64_t seed = 400;
  for (int64_t M : {37, 301})
    for (int64_t K : {75, 0})
      for (DType dt : {DType::f32, DType::bf16})
        for (Trans ta : kTrans)
          for (Trans tb : kTrans) {
            SCOPED_TRACE(testing::Message() << "M=" << M << " K=" << K << " ta=" << int(ta)
                                            << " tb=" << int(tb) << " " << dtype_name(dt));
            Problem p({ta, tb, M, 37, K, 1, 2, 3}, ++seed);
            Operands ops(p, dt);
            const int64_t ldr = 37 + 5;
            std::vector<float> r = randn(M * ldr, ++seed);
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 37; n < ldr; ++n) r[m * ldr + n] = NAN;
            std::vector<float> c(size_t(M * p.ldc), NAN);
            ops.args.C = c.data();
            ops.args.R = r.data();
            ops.args.ldr = ldr;
            if (K > 0) {
              EXPECT_EQ(gemm_parts(ops.args), M == 301 && splits_rows() ? 2 : 1);
            }
            gemm(ops.args);
            const auto ref = p.reference(false);
            int bad = 0;
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < 37; ++n) {
                const double want = ref[m * p.ldc + n] + r[m * ldr + n];
                const double tol = 1e-5 * (p.magnitude(m, n, false) + std::abs(r[m * ldr + n]));
                if (!(std::abs(c[m * p.ldc + n] - want) <= tol) && ++bad < 5)
                  ADD_FAILURE() << "C[" << m << "," << n << "] = " << c[m * p.ldc + n]
                                << ", expected " << want;
              }
            EXPECT_EQ(bad, 0);
          }
  // Misuse: with accumulate or a rounded output, a short ldr, R overlapping C.
  std::vector<float> a = randn(16, 1), c(16), r(16);
  GemmArgs g{.M = 4, .N = 4, .K = 4, .A = a.data(), .lda = 4, .B = a.data(), .ldb = 4};
  g.C = c.data();
  g.ldc = 4;
  g.R = r.data();
  g.ldr = 4;
  EXPECT_NO_THROW(gemm(g));
  GemmArgs bad = g;
  bad.accumulate = true;
  EXPECT_THROW(gemm(bad), Error);
  bad = g;
  bad.ldr = 3;
  EXPECT_THROW(gemm(bad), Error);
  bad = g;
  bad.R = c.data() + 2;
  EXPECT_THROW(gemm(bad), Error);
}

TEST(Gemm, LinearForms) {
  const int64_t M = 23, N = 19, K = 31;
  auto x = randn(M * K, 1), w = randn(N * K, 2), dy = randn(M * N, 3);
  auto dx = randn(M * K, 4), dw = randn(N * K, 5);
  const auto dx0 = dx, dw0 = dw;
  std::vector<float> y(M * N);
  linear_forward(x.data(), w.data(), y.data(), M, N, K, DType::f32);
  linear_backward_input(dy.data(), w.data(), dx.data(), M, N, K, DType::f32, true);
  linear_backward_weight(dy.data(), x.data(), dw.data(), M, N, K, DType::f32);
  std::vector<double> ry(M * N, 0), rdx(dx0.begin(), dx0.end()), rdw(dw0.begin(), dw0.end());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        ry[m * N + n] += double(x[m * K + k]) * w[n * K + k];
        rdx[m * K + k] += double(dy[m * N + n]) * w[n * K + k];
        rdw[n * K + k] += double(dy[m * N + n]) * x[m * K + k];
      }
  EXPECT_LT(test::rel_l2(y, ry), 1e-6);
  EXPECT_LT(test::rel_l2(dx, rdx), 1e-6);
  EXPECT_LT(test::rel_l2(dw, rdw), 1e-6);
  // Without accumulate, dx is overwritten.
  linear_backward_input(dy.data(), w.data(), dx.data(), M, N, K, DType::f32, false);
  for (int64_t i = 0; i < M * K; ++i) rdx[i] -= dx0[i];
  EXPECT_LT(test::rel_l2(dx, rdx), 1e-6);
}

// Host threads share the cached primitive of a shape; each call must still see its own buffers.
TEST(Gemm, ConcurrentCallsOfOneShape) {
  const int64_t M = 33, N = 17, K = 45;
  auto run = [&](uint64_t seed, double* err) {
    auto a = randn(M * K, seed), b = randn(K * N, seed + 1);
    std::vector<double> ref(M * N, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < N; ++n) ref[m * N + n] += double(a[m * K + k]) * b[k * N + n];
    double worst = 0;
    for (int it = 0; it < 50; ++it) {
      std::vector<float> c(M * N);
      gemm({.M = M,
            .N = N,
            .K = K,
            .A = a.data(),
            .lda = K,
            .B = b.data(),
            .ldb = N,
            .C = c.data(),
            .ldc = N});
      worst = std::max(worst, test::rel_l2(c, ref));
    }
    *err = worst;
  };
  double e1 = 1, e2 = 1;
  std::thread t1(run, 100, &e1), t2(run, 200, &e2);
  t1.join();
  t2.join();
  EXPECT_LT(e1, 1e-6);
  EXPECT_LT(e2, 1e-6);
}

TEST(Gemm, BadArgumentsThrow) {
  std::vector<float> a(100), b(100), c(100);
  auto args = [&] {
    return GemmArgs{.M = 4,
                    .N = 5,
                    .K = 6,
                    .A = a.data(),
                    .lda = 6,
                    .B = b.data(),
                    .ldb = 5,
                    .C = c.data(),
                    .ldc = 5};
  };
  EXPECT_NO_THROW(gemm(args()));
  auto g = args();
  g.lda = 5;
  EXPECT_THROW(gemm(g), Error);
  g = args();
  g.ta = Trans::T;  // A stored [K, M]: lda must be >= M = 4; 6 is fine
  EXPECT_NO_THROW(gemm(g));
  g.lda = 3;
  EXPECT_THROW(gemm(g), Error);
  g = args();
  g.ldb = 4;
  EXPECT_THROW(gemm(g), Error);
  g = args();
  g.ldc = 4;
  EXPECT_THROW(gemm(g), Error);
  g = args();
  g.ab = DType::i32;
  EXPECT_THROW(gemm(g), Error);
  g = args();
  g.M = -1;
  EXPECT_THROW(gemm(g), Error);
  g = args();
  g.C = nullptr;
  EXPECT_THROW(gemm(g), Error);
  try {
    g = args();
    g.ldb = 4;
    gemm(g);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ldb=4"), std::string::npos) << e.what();
  }
}

// The widening path (bf16 operands copied to f32, the f32 matmul) against the fp64 reference and
// against the native bf16 matmul where this CPU has one: the same bf16 inputs and f32
// accumulation, so the two differ only by the order of the f32 sums (1e-5 of sum |a b|). A
// 4 KiB chunk makes every operand span several row/column chunks.
TEST(Gemm, WidenedBf16MatchesReferenceAndNative) {
  const std::string path = gemm_bf16_path();
  EXPECT_TRUE(path.rfind("native (", 0) == 0 || path.rfind("widened to f32 (", 0) == 0) << path;
  for (size_t chunk : {kGemmWidenChunkBytes, size_t(4096)}) {
    ScopedGemmBf16Widen widen(chunk);
    EXPECT_FALSE(gemm_bf16_native());
    EXPECT_EQ(gemm_bf16_path().rfind("widened to f32", 0), 0u);
    for (Trans ta : kTrans)
      for (Trans tb : kTrans)
        for (bool acc : {false, true}) {
          check({ta, tb, 37, 29, 53}, DType::bf16, acc, 50);
          check({ta, tb, 37, 29, 53, 3, 5, 7}, DType::bf16, acc, 60);
          check({ta, tb, 130, 70, 200, 1, 2, 3}, DType::bf16, acc, 70);
        }
  }
  EXPECT_GT(gemm_widen_scratch_bytes(), 0u);
  const int64_t M = 67, N = 45, K = 300;
  auto a = randn(M * K, 7), b = randn(N * K, 8);
  std::vector<bf16> a16(a.size()), b16(b.size());
  for (size_t i = 0; i < a.size(); ++i) a16[i] = float_to_bf16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = float_to_bf16(b[i]);
  std::vector<float> native(M * N), widened(M * N);
  linear_forward(a16.data(), b16.data(), native.data(), M, N, K, DType::bf16);
  {
    ScopedGemmBf16Widen widen(4096);
    linear_forward(a16.data(), b16.data(), widened.data(), M, N, K, DType::bf16);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double mag = 0;
      for (int64_t k = 0; k < K; ++k)
        mag += std::abs(double(bf16_to_float(a16[m * K + k])) * bf16_to_float(b16[n * K + k]));
      ASSERT_NEAR(native[m * N + n], widened[m * N + n], 1e-5 * mag) << m << "," << n;
    }
}

// GemmArgs::C16: the product rounded to bf16, in place of C. Each element against the fp64
// reference: the f32 sum's error (1e-5 of sum_k |a b|) plus one rounding to bf16 (2^-8 of the
// value: half an ulp of its 8 significant bits); a wrong stride, transpose or chunk offset is
// off by far more. Padding of C untouched; f32 and bf16 inputs, native and widened
// (chunked) paths, every transpose, an empty K.
TEST(Gemm, RoundedOutputIsTheProductInBf16) {
  const bf16 sentinel = float_to_bf16(12345.0f);
  const auto run = [&](const Case& cs, DType dt, uint64_t seed) {
    SCOPED_TRACE(testing::Message() << "M=" << cs.M << " N=" << cs.N << " K=" << cs.K
                                    << " ta=" << int(cs.ta) << " tb=" << int(cs.tb)
                                    << " dtype=" << dtype_name(dt) << " path=" << gemm_bf16_path());
    Problem p(cs, seed);
    Operands ops(p, dt);
    std::vector<bf16> c(size_t(cs.M * p.ldc), sentinel);
    ops.args.C16 = c.data();
    gemm(ops.args);
    const auto ref = p.reference(false);
    int bad = 0;
    for (int64_t m = 0; m < cs.M; ++m)
      for (int64_t n = 0; n < p.ldc; ++n) {
        const bf16 got = c[size_t(m * p.ldc + n)];
        if (n >= cs.N) {
          if (got.bits != sentinel.bits && ++bad < 5)
            ADD_FAILURE() << "padding of C changed at " << m << "," << n;
          continue;
        }
        const double want = ref[size_t(m * p.ldc + n)];
        const double tol = 1e-5 * p.magnitude(m, n, false) + std::ldexp(std::abs(want), -8) + 1e-30;
        if (std::abs(bf16_to_float(got) - want) > tol && ++bad < 5)
          ADD_FAILURE() << "C[" << m << "," << n << "] = " << bf16_to_float(got) << ", expected "
                        << want;
      }
    EXPECT_EQ(bad, 0);
  };
  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      for (DType dt : {DType::f32, DType::bf16}) {
        run({ta, tb, 37, 29, 53, 3, 5, 7}, dt, 80);
        run({ta, tb, 130, 70, 200}, dt, 90);
        run({ta, tb, 5, 6, 0, 1, 1, 2}, dt, 95);  // K = 0: zeros
      }
  {
    ScopedGemmBf16Widen widen(4096);  // several chunks of A's rows and B's columns
    for (Trans ta : kTrans)
      for (Trans tb : kTrans) run({ta, tb, 130, 70, 200, 1, 2, 3}, DType::bf16, 100);
  }
  // Misuse: both outputs, or a rounded output that would accumulate.
  std::vector<float> f(4);
  std::vector<bf16> h(4);
  const std::vector<float> x = randn(4, 1);
  GemmArgs both{.M = 2, .N = 2, .K = 2, .A = x.data(), .lda = 2, .B = x.data(), .ldb = 2, .ldc = 2};
  both.C = f.data();
  both.C16 = h.data();
  EXPECT_THROW(gemm(both), Error);
  GemmArgs acc = both;
  acc.C = nullptr;
  acc.accumulate = true;
  EXPECT_THROW(gemm(acc), Error);
}

// B packed once and used by products with new A and C: each against the fp64 reference (check's
// tolerance) and against the plain gemm of the same operands, to 1e-6 of the error scale (oneDNN
// runs the same products; nothing promises it sums them in the same order for both layouts). Also
// at another M than the one packed for (a short last chunk), and accumulating.
TEST(Gemm, PackedBEqualsThePlainProduct) {
  const auto run = [&](const Case& cs, DType dt, int64_t pack_m, bool accumulate, uint64_t seed) {
    SCOPED_TRACE(testing::Message()
                 << "M=" << cs.M << " N=" << cs.N << " K=" << cs.K << " tb=" << int(cs.tb)
                 << " pack_m=" << pack_m << " dtype=" << dtype_name(dt) << " acc=" << accumulate
                 << " path=" << gemm_bf16_path());
    Problem p(cs, seed);
    Operands ops(p, dt);
    GemmArgs for_pack = ops.args;
    for_pack.M = pack_m;
    const PackedB packed = pack_b(for_pack);
    const bool expect_packed = dt == DType::f32 || gemm_bf16_native();
    EXPECT_EQ(bool(packed), expect_packed);
    EXPECT_EQ(packed.bytes(), packed_b_bytes(for_pack));
    if (expect_packed) {
      EXPECT_GE(packed.bytes(), size_t(cs.N * cs.K) * dtype_size(dt));
    }
    std::vector<float> plain = p.c0, got = p.c0;
    ops.args.accumulate = accumulate;
    ops.args.C = plain.data();
    gemm(ops.args);
    ops.args.C = got.data();
    gemm_packed(ops.args, packed);
    const auto ref = p.reference(accumulate);
    int bad = 0;
    for (int64_t m = 0; m < cs.M; ++m)
      for (int64_t n = 0; n < p.ldc; ++n) {
        const size_t i = size_t(m * p.ldc + n);
        if (n >= cs.N) {
          if (got[i] != p.c0[i] && ++bad < 5)
            ADD_FAILURE() << "padding of C changed at " << m << "," << n;
          continue;
        }
        const double scale = p.magnitude(m, n, accumulate) + 1e-30;
        if (std::abs(got[i] - plain[i]) > 1e-6 * scale && ++bad < 5)
          ADD_FAILURE() << "C[" << m << "," << n << "] = " << got[i] << ", the plain GEMM gave "
                        << plain[i];
        if (std::abs(got[i] - ref[i]) > 1e-5 * scale && ++bad < 5)
          ADD_FAILURE() << "C[" << m << "," << n << "] = " << got[i] << ", expected " << ref[i];
      }
    EXPECT_EQ(bad, 0);
  };
  for (DType dt : {DType::f32, DType::bf16})
    for (Trans tb : kTrans) {
      run({Trans::N, tb, 64, 300, 72, 0, 3, 5}, dt, 64, false, 110);
      run({Trans::N, tb, 23, 300, 72, 0, 3, 5}, dt, 64, false, 111);  // the short last chunk
      run({Trans::N, tb, 64, 130, 57}, dt, 64, true, 112);
    }
  {
    ScopedGemmBf16Widen widen;  // nothing to pack: the plain (widened) product
    run({Trans::N, Trans::T, 64, 300, 72}, DType::bf16, 64, false, 113);
  }
  // Misuse: another shape than packed for, and a null B.
  Problem p({Trans::N, Trans::T, 16, 32, 48}, 114);
  Operands ops(p, DType::f32);
  const PackedB packed = pack_b(ops.args);
  std::vector<float> c(size_t(16 * 32));
  GemmArgs other = ops.args;
  other.C = c.data();
  other.N = 16;
  EXPECT_THROW(gemm_packed(other, packed), Error);
  GemmArgs null_b = ops.args;
  null_b.B = nullptr;
  EXPECT_THROW(pack_b(null_b), Error);
}

TEST(Gemm, PeakIsPositive) {
  const double p = measure_gemm_peak(DType::f32, 0.05);
  EXPECT_GT(p, 1e9);  // any machine that runs this does over 1 GFLOP/s
}

}  // namespace
}  // namespace loom::cpu
