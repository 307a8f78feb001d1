// The CUDA fused loss and vocabulary-parallel loss pieces against the CPU kernels
// (kernels/cpu/cross_entropy.hpp, kernels/cpu/sharded.hpp): random inputs (never zeros), outputs
// filled with NaN first so that an element the kernel missed fails, ignored rows, odd N (1, 37)
// and V (1000, 1001, 4097), one chunk and several (the last one short), bf16 gradient groups,
// dw accumulated and overwritten, an out-of-range target recorded and named, a Llama 2 vocabulary
// (32000) and Llama 3's (128256) with a chunk far smaller than the logits of all rows.
#include "kernels/cuda/cross_entropy.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/sharded.hpp"
#include "kernels/cuda/gemm.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

class CrossEntropyCuda : public test::CudaTest {
 protected:
  void SetUp() override {
    test::CudaTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    cuda::set_allow_tf32(false);  // f32 GEMMs in exact f32, as the CPU's
  }
};

// The CPU test's problem: x ~ N(0, 1), w ~ N(0, 0.25), every fifth row ignored, row 0 aimed at
// the last vocabulary entry, grad_scale = 1 / the targets counted.
struct Problem {
  int64_t N, D, V;
  std::vector<float> x, w;
  std::vector<int32_t> t;
  float scale = 1;
  Problem(int64_t n, int64_t d, int64_t v, uint64_t seed) : N(n), D(d), V(v) {
    x = test::randn(size_t(N * D), seed);
    w = test::randn(size_t(V * D), seed + 1, 0.5f);
    std::mt19937 rng(uint32_t(seed + 2));
    t.resize(size_t(N));
    int count = 0;
    for (int64_t i = 0; i < N; ++i) {
      t[size_t(i)] = int32_t(rng() % uint32_t(V));
      if (i % 5 == 3) t[size_t(i)] = -1;
      count += t[size_t(i)] >= 0;
    }
    t[0] = int32_t(V - 1);
    scale = 1.0f / float(count);
  }
};

struct Opts {
  DType ab = DType::f32;
  int64_t chunk = 0, grad_rows = 0;
  bool dx = true, dw = true, overwrite = false;
};

struct Out {
  double loss = 0;
  std::vector<float> dx, dw;
};

std::string name(const Problem& p, const Opts& o) {
  return std::string(dtype_name(o.ab)) + " N=" + std::to_string(p.N) + " D=" + std::to_string(p.D) +
         " V=" + std::to_string(p.V) + " chunk=" + std::to_string(o.chunk) +
         " grad_rows=" + std::to_string(o.grad_rows) + (o.overwrite ? " overwrite" : " accumulate");
}

// What dw holds before an accumulating call: comparable to the gradient, so that an overwrite
// instead of an addition fails.
std::vector<float> initial_dw(const Problem& p) {
  return test::randn(size_t(p.V * p.D), 77, 0.01f);
}

Out run_cpu(const Problem& p, const Opts& o) {
  const Tensor x = test::to_host_tensor(p.x, o.ab), w = test::to_host_tensor(p.w, o.ab);
  Out r;
  if (o.dx) r.dx.assign(size_t(p.N * p.D), 123.0f);
  if (o.dw) r.dw = o.overwrite ? std::vector<float>(size_t(p.V * p.D), 5.0f) : initial_dw(p);
  cpu::LinearCrossEntropyArgs a;
  a.x = x.raw();
  a.w = w.raw();
  a.ab = o.ab;
  a.targets = p.t.data();
  a.N = p.N;
  a.D = p.D;
  a.V = p.V;
  a.grad_scale = p.scale;
  a.dx = o.dx ? r.dx.data() : nullptr;
  a.dw = o.dw ? r.dw.data() : nullptr;
  a.dw_overwrite = o.overwrite;
  a.chunk_rows = o.chunk;
  a.grad_rows = o.grad_rows;
  r.loss = cpu::linear_cross_entropy(a);
  return r;
}

// One double or one uint64 of device memory.
Tensor device_scalar(double v) {
  Tensor h = Tensor::empty({2}, DType::i32);
  std::memcpy(h.raw(), &v, sizeof v);
  Tensor d = Tensor::empty({2}, DType::i32, Device::cuda);
  d.copy_from(h);
  return d;
}
double host_double(const Tensor& d) {
  Tensor h = Tensor::empty({2}, DType::i32);
  h.copy_from(d);
  double v = 0;
  std::memcpy(&v, h.raw(), sizeof v);
  return v;
}
double* dbl(const Tensor& t) {
  return static_cast<double*>(t.raw());
}
uint64_t* u64(const Tensor& t) {
  return static_cast<uint64_t*>(t.raw());
}
Tensor new_record() {
  Tensor r = device_scalar(0.0);
  cuda::clear_bad_target(u64(r));
  return r;
}

struct Call {
  Tensor x, w, t, dx, dw, loss, record;
  cuda::LinearCrossEntropyArgs a;
};
// The device inputs and NaN-poisoned outputs of a call (dw holds initial_dw when it accumulates).
Call prepare(const Problem& p, const Opts& o) {
  Call d;
  d.x = test::to_device(p.x, o.ab);
  d.w = test::to_device(p.w, o.ab);
  d.t = test::to_device_i32(p.t);
  if (o.dx) d.dx = test::nan_device(p.N * p.D);
  if (o.dw) d.dw = o.overwrite ? test::nan_device(p.V * p.D) : test::to_device(initial_dw(p));
  d.loss = device_scalar(kNaN);
  d.record = new_record();
  d.a.x = d.x.raw();
  d.a.w = d.w.raw();
  d.a.ab = o.ab;
  d.a.targets = d.t.data<int32_t>();
  d.a.N = p.N;
  d.a.D = p.D;
  d.a.V = p.V;
  d.a.grad_scale = p.scale;
  d.a.dx = o.dx ? d.dx.data<float>() : nullptr;
  d.a.dw = o.dw ? d.dw.data<float>() : nullptr;
  d.a.dw_overwrite = o.overwrite;
  d.a.chunk_rows = o.chunk;
  d.a.grad_rows = o.grad_rows;
  return d;
}
Out results(const Call& d, const Opts& o) {
  Out r;
  r.loss = host_double(d.loss);
  if (o.dx) r.dx = test::to_host(d.dx);
  if (o.dw) r.dw = test::to_host(d.dw);
  return r;
}

Out run_gpu(const Problem& p, const Opts& o) {
  Call d = prepare(p, o);
  cuda::linear_cross_entropy(d.a, dbl(d.loss), u64(d.record));
  cuda::check_bad_target(u64(d.record), p.V);
  return results(d, o);
}

// The loss within 1e-5 relative (f32 logits either way: only the order of the sums, the exp and
// the log differ), dx and dw within the given relative L2, the rows of ignored targets of dx
// exactly zero (a zero gradient row times w).
void expect_like_cpu(const Out& got, const Out& want, const Problem& p, double dx_tol,
                     double dw_tol) {
  EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
  if (!want.dx.empty()) {
    EXPECT_LE(test::rel_l2(got.dx, want.dx), dx_tol) << "dx";
    for (int64_t i = 0; i < p.N; ++i)
      if (p.t[size_t(i)] < 0) {
        for (int64_t k = 0; k < p.D; ++k)
          ASSERT_EQ(got.dx[size_t(i * p.D + k)], 0.0f) << "dx of ignored row " << i;
      }
  }
  if (!want.dw.empty()) {
    EXPECT_LE(test::rel_l2(got.dw, want.dw), dw_tol) << "dw";
  }
}

// f32: 1e-5 relative L2. dx's GEMM sums over the vocabulary (K = V): an f32 dot product summed in
// one sequence drifts by about sqrt(V) roundings of the running sum, ~2e-5 at V 128256 and ~6e-6
// at 32000 (measured on inputs like these against fp64; blocked sums stay near 4e-7); cuBLASLt may
// or may not split K. So past V 4096 dx's bound grows as sqrt(V / 4096): 2.8e-5 at 32000, 5.6e-5
// at 128256, still far below what a wrong row, chunk or scale gives (O(1)).
constexpr double kF32Tol = 1e-5;
double f32_dx_tol(int64_t V) {
  return V <= 4096 ? kF32Tol : kF32Tol * std::sqrt(double(V) / 4096.0);
}
// bf16: the logit gradients are rounded to bf16 on both sides from f32 values that differ in the
// last bits, so an element may round one bf16 ulp apart (2^-8 to 2^-7 relative); the CPU test's
// bound for bf16 against fp64 (1e-2) holds against the CPU's bf16 path too.
constexpr double kBf16Tol = 1e-2;

void check_case(const Problem& p, Opts o) {
  for (const bool overwrite : {false, true}) {
    o.overwrite = overwrite;
    SCOPED_TRACE(name(p, o));
    const Out want = run_cpu(p, o), got = run_gpu(p, o);
    if (o.ab == DType::f32)
      expect_like_cpu(got, want, p, f32_dx_tol(p.V), kF32Tol);
    else
      expect_like_cpu(got, want, p, kBf16Tol, kBf16Tol);
  }
}

struct Case {
  int64_t N, D, V, chunk, grad_rows;
};

}  // namespace

// ---- host-side logic (no GPU needed)

TEST(CrossEntropyCudaHost, ChunksAndScratch) {
  // The automatic chunk: 256 MiB of f32 logits, a multiple of 64 rows.
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(16384, 128256, 0, 0).rows, 512);
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(16384, 32000, 0, 0).rows, 2048);
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(37, 1000, 0, 0).rows, 37);
  // Past 256 MiB a row: one row a chunk.
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(5, int64_t{1} << 27, 0, 0).rows, 1);
  // The CPU's grad_rows rule: a multiple of the chunk, at least one chunk, at most N.
  const cpu::LinearCrossEntropyChunks g = cuda::linear_cross_entropy_chunks(37, 1000, 8, 20);
  EXPECT_EQ(g.rows, 8);
  EXPECT_EQ(g.grad_rows, 16);
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(37, 1000, 8, 0).grad_rows, 8);
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(37, 1000, 4, 1000).grad_rows, 37);
  EXPECT_EQ(cuda::linear_cross_entropy_chunks(0, 1000, 0, 0).rows, 0);
  // Llama 3 at 16384 rows: one chunk of logits (256 MiB), not all of them (8 GiB).
  const size_t mib = size_t(1) << 20;
  const size_t f32 =
      cuda::linear_cross_entropy_scratch_bytes(16384, 4096, 128256, DType::f32, true);
  EXPECT_GE(f32, size_t(512) * 128256 * 4 + 16384 * 8);
  EXPECT_LE(f32, 257 * mib);
  // bf16 with gradients: a chunk's bf16 gradients besides (grad_rows 0: one chunk's).
  const size_t b16 =
      cuda::linear_cross_entropy_scratch_bytes(16384, 4096, 128256, DType::bf16, true);
  EXPECT_GE(b16, size_t(512) * 128256 * 6 + 16384 * 8);
  EXPECT_LE(b16, 385 * mib);
  // Without gradients, or in f32, no bf16 gradients.
  EXPECT_EQ(cuda::linear_cross_entropy_scratch_bytes(16384, 4096, 128256, DType::bf16, false), f32);
  // Gathered bf16 gradients: 2048 rows of them.
  EXPECT_GE(
      cuda::linear_cross_entropy_scratch_bytes(16384, 4096, 128256, DType::bf16, true, 0, 2048),
      size_t(512) * 128256 * 4 + size_t(2048) * 128256 * 2);
  EXPECT_EQ(cuda::linear_cross_entropy_scratch_bytes(0, 4096, 128256, DType::f32, true), 0u);
}

TEST(CrossEntropyCudaHost, BadTargetMessageNamesTheRow) {
  cuda::bad_target_error(cuda::kNoBadTarget, 17);  // nothing to throw
  test::expect_error([] { cuda::bad_target_error((uint64_t{5} << 32) | 17u, 17); },
                     {"linear_cross_entropy", "target 17 of row 5", "vocabulary of 17"});
}

// ---- the fused loss

TEST_F(CrossEntropyCuda, F32MatchesCpu) {
  // One chunk and several (8 rows: the last short; 1 row: 37 chunks); V a multiple of 4 and not
  // (rows that start off the 16-byte boundary: the scalar head and tail).
  const Case cases[] = {{1, 32, 1000, 0, 0},  {1, 24, 4097, 0, 0},  {37, 64, 1000, 0, 0},
                        {37, 64, 1000, 8, 0}, {37, 40, 4097, 5, 0}, {37, 16, 1001, 1, 0}};
  for (const Case& c : cases) {
    const Problem p(c.N, c.D, c.V, uint64_t(c.N * 7 + c.V));
    check_case(p, {.ab = DType::f32, .chunk = c.chunk, .grad_rows = c.grad_rows});
  }
}

TEST_F(CrossEntropyCuda, Bf16MatchesCpu) {
  const test::ScopedBf16Native software(false);  // the CPU rounds as the GPU: no denormal flush
  // Gradient groups of one chunk; of 3 chunks (15 rows: groups 15, 15, 7); 20 rounded down to 16
  // (two chunks of 8); all 37 rows in one group of 4-row chunks (the last chunk 1 row).
  const Case cases[] = {{1, 32, 1000, 0, 0},    {37, 64, 1000, 0, 0},  {37, 64, 1000, 8, 0},
                        {37, 40, 4097, 5, 0},   {37, 40, 4097, 5, 15}, {37, 40, 4097, 8, 20},
                        {37, 64, 1000, 4, 1000}};
  for (const Case& c : cases) {
    const Problem p(c.N, c.D, c.V, uint64_t(c.N * 11 + c.V));
    check_case(p, {.ab = DType::bf16, .chunk = c.chunk, .grad_rows = c.grad_rows});
  }
}

// Without gradients the loss is the same computation up to the loss: the same bits. dx alone and
// dw alone are each what the call with both gives (the same GEMMs on the same gradients: equal
// unless cuBLASLt's algorithms were not deterministic, so held to 1e-6 only).
TEST_F(CrossEntropyCuda, LossOnlyAndOneGradient) {
  const test::ScopedBf16Native software(false);
  for (const DType ab : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(ab));
    const Problem p(37, 40, 4097, 5);
    const Opts both{.ab = ab, .chunk = 8};
    const Out full = run_gpu(p, both);
    Opts o = both;
    o.dx = o.dw = false;
    EXPECT_EQ(run_gpu(p, o).loss, full.loss);
    o.dx = true;
    const Out dx_only = run_gpu(p, o);
    EXPECT_EQ(dx_only.loss, full.loss);
    EXPECT_LE(test::rel_l2(dx_only.dx, full.dx), 1e-6);
    o.dx = false;
    o.dw = true;
    const Out dw_only = run_gpu(p, o);
    EXPECT_EQ(dw_only.loss, full.loss);
    EXPECT_LE(test::rel_l2(dw_only.dw, full.dw), 1e-6);
    // Against the CPU too.
    const Out want = run_cpu(p, both);
    const double tol = ab == DType::f32 ? kF32Tol : kBf16Tol;
    expect_like_cpu(dx_only, Out{want.loss, want.dx, {}}, p, tol, tol);
    expect_like_cpu(dw_only, Out{want.loss, {}, want.dw}, p, tol, tol);
  }
}

// Every target ignored: a zero loss, dx zero, dw zeroed (overwrite) or left as it was (its bits:
// adding an all-zero product).
TEST_F(CrossEntropyCuda, AllRowsIgnored) {
  for (const DType ab : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(ab));
    Problem p(37, 40, 1001, 6);
    p.t.assign(p.t.size(), -1);
    p.scale = 1;
    for (const bool overwrite : {false, true}) {
      const Opts o{.ab = ab, .chunk = 8, .overwrite = overwrite};
      const Out got = run_gpu(p, o);
      EXPECT_EQ(got.loss, 0.0);
      EXPECT_EQ(got.dx, std::vector<float>(got.dx.size(), 0.0f));
      if (overwrite)
        EXPECT_EQ(got.dw, std::vector<float>(got.dw.size(), 0.0f));
      else
        EXPECT_EQ(got.dw, initial_dw(p));
    }
  }
}

// The loss's sum is in a fixed order: two runs, the same bits (cuBLASLt gives the same logits for
// the same algorithm; the row kernel and the sum depend on the shapes alone).
TEST_F(CrossEntropyCuda, LossIsDeterministic) {
  const Problem p(37, 64, 1000, 8);
  const Opts o{.chunk = 8};
  EXPECT_EQ(run_gpu(p, o).loss, run_gpu(p, o).loss);
}

// N == 0: dw zeroed when overwritten, else untouched; the loss 0.
TEST_F(CrossEntropyCuda, NoRows) {
  const int64_t D = 8, V = 33;
  const auto dw0 = test::randn(size_t(V * D), 9);
  for (const bool overwrite : {false, true}) {
    const Tensor dw = test::to_device(dw0), loss = device_scalar(kNaN);
    cuda::LinearCrossEntropyArgs a;
    a.N = 0;
    a.D = D;
    a.V = V;
    a.dw = dw.data<float>();
    a.dw_overwrite = overwrite;
    cuda::linear_cross_entropy(a, dbl(loss), nullptr);
    EXPECT_EQ(host_double(loss), 0.0);
    EXPECT_EQ(test::to_host(dw), overwrite ? std::vector<float>(dw0.size(), 0.0f) : dw0);
  }
}

TEST_F(CrossEntropyCuda, BadArguments) {
  const Problem p(4, 8, 33, 10);
  Call d = prepare(p, {});
  auto call = [&](cuda::LinearCrossEntropyArgs a) {
    cuda::linear_cross_entropy(a, dbl(d.loss), u64(d.record));
  };
  cuda::LinearCrossEntropyArgs a = d.a;
  a.ab = DType::i32;
  EXPECT_THROW(call(a), Error);
  a = d.a;
  a.D = 0;
  EXPECT_THROW(call(a), Error);
  a = d.a;
  a.V = 0;
  EXPECT_THROW(call(a), Error);
  a = d.a;
  a.N = -1;
  EXPECT_THROW(call(a), Error);
  a = d.a;
  a.chunk_rows = -1;
  EXPECT_THROW(call(a), Error);
  a = d.a;
  a.targets = nullptr;
  EXPECT_THROW(call(a), Error);
  a = d.a;
  a.x = nullptr;
  EXPECT_THROW(call(a), Error);
}

// A target >= V. With a record: nothing waits, the row's gradient is zero and its loss NaN (so
// the summed loss is NaN), and the record names the first bad row and its target; the record
// keeps the smallest row over calls until it is cleared. Without one: the call throws the CPU's
// error naming the row before it writes anything.
TEST_F(CrossEntropyCuda, OutOfRangeTargetNamesTheRow) {
  Problem p(37, 16, 1001, 11);
  p.t[9] = 1001 + 40;
  p.t[5] = 1001;  // the first bad row
  const Opts o{.chunk = 8};
  Call d = prepare(p, o);
  cuda::linear_cross_entropy(d.a, dbl(d.loss), u64(d.record));
  test::expect_error([&] { cuda::check_bad_target(u64(d.record), p.V); },
                     {"linear_cross_entropy", "target 1001 of row 5", "vocabulary of 1001"});
  EXPECT_TRUE(std::isnan(host_double(d.loss)));
  const auto dx = test::to_host(d.dx);
  for (const int64_t i : {5, 9})
    for (int64_t k = 0; k < p.D; ++k) ASSERT_EQ(dx[size_t(i * p.D + k)], 0.0f) << "row " << i;
  for (const float v : test::to_host(d.dw)) ASSERT_FALSE(std::isnan(v));
  // The other rows as the CPU gives them with those two ignored.
  Problem q = p;
  q.t[5] = q.t[9] = -1;
  const Out want = run_cpu(q, o);
  EXPECT_LE(test::rel_l2(dx, want.dx), kF32Tol);
  EXPECT_LE(test::rel_l2(test::to_host(d.dw), want.dw), kF32Tol);

  // A later call with a bad row before row 5 lowers the record; cleared, it holds nothing; the
  // first call again records row 5.
  Problem r = q;
  r.t[2] = 5000;
  Call e = prepare(r, o);
  cuda::linear_cross_entropy(e.a, dbl(e.loss), u64(d.record));
  test::expect_error([&] { cuda::check_bad_target(u64(d.record), p.V); }, {"target 5000 of row 2"});
  cuda::clear_bad_target(u64(d.record));
  cuda::check_bad_target(u64(d.record), p.V);  // cleared: no error
  cuda::linear_cross_entropy(d.a, dbl(d.loss), u64(d.record));
  test::expect_error([&] { cuda::check_bad_target(u64(d.record), p.V); }, {"row 5"});

  // Without a record: thrown before dx, dw or the loss are touched.
  for (const bool overwrite : {false, true}) {
    Opts oo = o;
    oo.overwrite = overwrite;
    Call f = prepare(p, oo);
    const auto dw_before = test::to_host(f.dw);
    test::expect_error([&] { cuda::linear_cross_entropy(f.a, dbl(f.loss), nullptr); },
                       {"linear_cross_entropy", "target 1001 of row 5", "vocabulary of 1001"});
    const auto dx_after = test::to_host(f.dx), dw_after = test::to_host(f.dw);
    for (const float v : dx_after) ASSERT_TRUE(std::isnan(v)) << "dx written";
    ASSERT_EQ(std::memcmp(dw_after.data(), dw_before.data(), dw_before.size() * sizeof(float)), 0)
        << "dw written";
    EXPECT_TRUE(std::isnan(host_double(f.loss))) << "loss written";
  }
  // Checked later (the CUDA backend's call): nothing waits, the record path's results (rows 5 and
  // 9 a zero gradient, the loss NaN), and the next wait throws, once.
  {
    Call h = prepare(p, o);
    const uint64_t before = test::host_wait_count();
    cuda::linear_cross_entropy_checked_later(h.a, dbl(h.loss));
    EXPECT_EQ(test::host_wait_count(), before) << "linear_cross_entropy_checked_later waited";
    test::expect_error([&] { cuda::synchronize("the test's wait"); },
                       {"linear_cross_entropy", "target 1001 of row 5", "vocabulary of 1001"});
    cuda::synchronize("the test's wait");
    EXPECT_TRUE(std::isnan(host_double(h.loss)));
    const auto hdx = test::to_host(h.dx);
    for (const int64_t i : {5, 9})
      for (int64_t k = 0; k < p.D; ++k) ASSERT_EQ(hdx[size_t(i * p.D + k)], 0.0f) << "row " << i;
    EXPECT_LE(test::rel_l2(hdx, want.dx), kF32Tol);
    EXPECT_LE(test::rel_l2(test::to_host(h.dw), want.dw), kF32Tol);
  }
  // The stream is usable afterwards, and a valid call without a record goes through.
  Call g = prepare(q, o);
  cuda::linear_cross_entropy(g.a, dbl(g.loss), nullptr);
  const Out got = results(g, o);
  EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
}

// Llama 2's vocabulary (32000) with a few rows: one automatic chunk, and chunks of 7 rows.
TEST_F(CrossEntropyCuda, LlamaVocab32000) {
  const test::ScopedBf16Native software(false);
  const Problem p(24, 64, 32000, 12);
  for (const int64_t chunk : {0, 7}) {
    check_case(p, {.ab = DType::f32, .chunk = chunk});
    check_case(p, {.ab = DType::bf16, .chunk = chunk});
  }
  check_case(p, {.ab = DType::bf16, .chunk = 7, .grad_rows = 14});
}

// Llama 3's vocabulary (128256): 64 rows as one automatic chunk and as four chunks of 16, whose
// scratch (what the caching allocator hands out during the call) is one chunk of logits, a
// quarter of all rows' logits.
TEST_F(CrossEntropyCuda, Vocab128256InChunks) {
  const test::ScopedBf16Native software(false);
  const Problem p(64, 32, 128256, 13);
  for (const int64_t chunk : {0, 16}) {
    check_case(p, {.ab = DType::f32, .chunk = chunk});
    check_case(p, {.ab = DType::bf16, .chunk = chunk});
  }
  check_case(p, {.ab = DType::bf16, .chunk = 16, .grad_rows = 32});

  const Opts o{.chunk = 16};
  Call d = prepare(p, o);
  cuda::linear_cross_entropy(d.a, dbl(d.loss), u64(d.record));  // the GEMM workspace exists
  Allocator& alloc = Allocator::get(Device::cuda);
  alloc.reset_peak();
  const auto before = alloc.stats();
  cuda::linear_cross_entropy(d.a, dbl(d.loss), u64(d.record));
  const auto after = alloc.stats();
  const size_t scratch =
      cuda::linear_cross_entropy_scratch_bytes(p.N, p.D, p.V, DType::f32, true, 16);
  EXPECT_GE(scratch, size_t(16) * 128256 * 4);
  EXPECT_LT(scratch, size_t(64) * 128256 * 4 / 2);
  EXPECT_GE(after.peak_allocated - before.allocated, scratch);
  EXPECT_LE(after.peak_allocated - before.allocated, Allocator::round_size(scratch));
  EXPECT_EQ(after.allocated, before.allocated);
  cuda::check_bad_target(u64(d.record), p.V);
}

// ---- the vocabulary-parallel pieces

namespace {

// This rank's columns [v0, v0 + V) of which the first Vr are real; targets on this rank's real
// columns, on its padding, on other ranks and ignored.
struct Shard {
  int64_t rows = 37, V = 1001, Vr = 997, v0 = 2000;
  std::vector<float> logits;
  std::vector<int32_t> t;
  explicit Shard(uint64_t seed) {
    logits = test::randn(size_t(rows * V), seed, 3.0f);
    std::mt19937 rng(static_cast<uint32_t>(seed));
    t.resize(size_t(rows));
    for (int64_t i = 0; i < rows; ++i) {
      const uint32_t u = rng();
      switch (i % 5) {
        case 0:
        case 1:
          t[size_t(i)] = int32_t(v0 + int64_t(u % uint32_t(Vr)));
          break;
        case 2:
          t[size_t(i)] = int32_t(u % uint32_t(v0));
          break;  // another rank's
        case 3:
          t[size_t(i)] = -1;
          break;
        default:
          t[size_t(i)] = int32_t(v0 + V + int64_t(u % 1000));
          break;
      }
    }
    t[4] = int32_t(v0 + Vr + 1);   // a padding column
    t[6] = int32_t(v0);            // the first column
    t[11] = int32_t(v0 + Vr - 1);  // the last real one
  }
};

// A device copy of v `off` floats into its buffer (off 1: rows off the 16-byte boundary).
struct Dev {
  Tensor t;
  int64_t off = 0;
  float* f() const { return t.data<float>() + off; }
  std::vector<float> host() const {
    const auto v = test::to_host(t);
    return std::vector<float>(v.begin() + off, v.end());
  }
};
Dev dev(const std::vector<float>& v, int64_t off = 0) {
  std::vector<float> padded(size_t(off), 1.0f);
  padded.insert(padded.end(), v.begin(), v.end());
  return {test::to_device(padded), off};
}
Dev nan_dev(int64_t n) {
  return {test::nan_device(n), 0};
}

}  // namespace

TEST_F(CrossEntropyCuda, VocabShardLseMatchesCpu) {
  for (const int64_t off : {0, 1}) {
    for (const int64_t Vr : {997, 1001, 0}) {
      SCOPED_TRACE("offset " + std::to_string(off) + " Vr " + std::to_string(Vr));
      Shard s(20);
      s.Vr = Vr;
      std::vector<float> lse(size_t(s.rows)), tl(size_t(s.rows));
      cpu::vocab_shard_lse(s.logits.data(), s.rows, s.V, s.Vr, s.t.data(), s.v0, lse.data(),
                           tl.data());
      const Dev l = dev(s.logits, off), g_lse = nan_dev(s.rows), g_tl = nan_dev(s.rows);
      const Tensor t = test::to_device_i32(s.t);
      cuda::vocab_shard_lse(l.f(), s.rows, s.V, s.Vr, t.data<int32_t>(), s.v0, g_lse.f(), g_tl.f());
      EXPECT_EQ(g_tl.host(), tl);  // copies of logits, or zeros
      if (Vr == 0)
        EXPECT_EQ(g_lse.host(), lse);  // -inf
      else
        EXPECT_LE(test::rel_l2(g_lse.host(), lse), 1e-6);
    }
  }
}

TEST_F(CrossEntropyCuda, VocabShardCombineMatchesCpu) {
  const int n = 3;
  const int64_t N = 37;
  auto lse_all = test::randn(size_t(n * N), 21, 2.0f);
  for (auto& v : lse_all) v += 7.0f;
  for (int64_t i = 0; i < N; i += 4) lse_all[size_t(2 * N + i)] = -INFINITY;  // padding-only rank
  const auto tl = test::randn(size_t(N), 22, 3.0f);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[size_t(i)] = i % 5 == 3 ? -1 : int32_t(i * 13);
  std::vector<float> glse(static_cast<size_t>(N));
  const double want =
      cpu::vocab_shard_combine(lse_all.data(), n, N, t.data(), tl.data(), glse.data());
  const Dev d_all = dev(lse_all), d_tl = dev(tl), d_glse = nan_dev(N);
  const Tensor d_t = test::to_device_i32(t), loss = device_scalar(kNaN);
  cuda::vocab_shard_combine(d_all.f(), n, N, d_t.data<int32_t>(), d_tl.f(), d_glse.f(), dbl(loss));
  EXPECT_LE(test::rel_l2(d_glse.host(), glse), 1e-6);
  EXPECT_NEAR(host_double(loss), want, 1e-6 * std::abs(want));
  // No rows: the loss 0.
  const Tensor loss0 = device_scalar(kNaN);
  cuda::vocab_shard_combine(d_all.f(), n, 0, d_t.data<int32_t>(), d_tl.f(), d_glse.f(), dbl(loss0));
  EXPECT_EQ(host_double(loss0), 0.0);
}

TEST_F(CrossEntropyCuda, VocabShardDlogitsMatchesCpu) {
  for (const int64_t off : {0, 1}) {
    SCOPED_TRACE("offset " + std::to_string(off));
    const Shard s(23);
    // The global log-sum-exp of a plausible run: this rank's plus a little.
    std::vector<float> lse(size_t(s.rows)), tl(size_t(s.rows));
    cpu::vocab_shard_lse(s.logits.data(), s.rows, s.V, s.Vr, s.t.data(), s.v0, lse.data(),
                         tl.data());
    for (auto& v : lse) v += 0.5f;
    const float scale = 1.0f / 29.0f;
    auto want = s.logits;
    cpu::vocab_shard_dlogits(want.data(), s.rows, s.V, s.Vr, s.t.data(), s.v0, lse.data(), scale);
    const Dev l = dev(s.logits, off), g = dev(lse);
    const Tensor t = test::to_device_i32(s.t);
    cuda::vocab_shard_dlogits(l.f(), s.rows, s.V, s.Vr, t.data<int32_t>(), s.v0, g.f(), scale);
    const auto got = l.host();
    EXPECT_LE(test::rel_l2(got, want), 1e-6);
    // Zeros (ignored rows, padding) and the padding target's -scale exactly.
    for (size_t i = 0; i < got.size(); ++i)
      if (want[i] == 0.0f || want[i] == -scale) {
        ASSERT_EQ(got[i], want[i]) << "element " << i;
      }
  }
}
