// The CUDA embedding kernels against the CPU kernels (kernels/cpu/embedding.hpp and the range
// variants of kernels/cpu/sharded.hpp): gathers bit for bit, out-of-range tokens named in the
// error, the backward deterministic and equal to the CPU's serial sums over repeated tokens (Zipf
// tokens, one token repeated throughout), unaligned pointers (the scalar path), and the widths of
// Llama 3.2 1B (2048) and Llama 3 8B (4096).
#include "kernels/cuda/embedding.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/sharded.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

class EmbeddingCuda : public test::CudaTest {};

struct Sizes {
  int64_t n, vocab, dim;
  std::string name() const {
    return "n" + std::to_string(n) + " vocab" + std::to_string(vocab) + " dim" +
           std::to_string(dim);
  }
};

// dim 7, 50, 513: the scalar path; 2048 and 4096: Llama 3.2 1B and Llama 3 8B (a small vocabulary:
// the table's rows are what matters, not how many); 9000 tokens of 60000: more distinct tokens
// than the backward's last kernel has blocks (each takes several runs).
const std::vector<Sizes> kShapes = {{1, 3, 7},        {37, 50, 288},   {2048, 301, 50},
                                    {5, 7, 513},      {513, 7, 96},    {64, 1000, 2048},
                                    {48, 1000, 4096}, {9000, 60000, 8}};

// A device array holding v `off` elements into its buffer (off > 0: not 16-byte aligned).
struct Dev {
  Tensor t;
  int64_t off = 0;
  float* f() const { return t.data<float>() + off; }
  std::vector<float> host() const {
    auto v = test::to_host(t);
    return std::vector<float>(v.begin() + off, v.end());
  }
};
Dev dev(const std::vector<float>& v, int64_t off = 0) {
  std::vector<float> padded(size_t(off), 1.0f);
  padded.insert(padded.end(), v.begin(), v.end());
  return {test::to_device(padded), off};
}
Dev nan_dev(int64_t n, int64_t off = 0) {
  return {test::nan_device(n + off), off};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_F(EmbeddingCuda, ForwardGathersRows) {
  for (const Sizes& s : kShapes) {
    for (const int64_t off : {0, 1}) {
      SCOPED_TRACE(s.name() + " offset " + std::to_string(off));
      const auto table = test::randn(size_t(s.vocab * s.dim), 1);
      const auto tok = test::random_tokens(s.n, s.vocab, 2);
      std::vector<float> out(size_t(s.n * s.dim));
      cpu::embedding_forward(tok.data(), s.n, table.data(), s.vocab, s.dim, out.data());
      const Dev dt = dev(table, off), dout = nan_dev(s.n * s.dim, off);
      const Tensor dtok = test::to_device_i32(tok);
      cuda::embedding_forward(dtok.data<int32_t>(), s.n, dt.f(), s.vocab, s.dim, dout.f());
      EXPECT_TRUE(same_bits(dout.host(), out));
    }
  }
}

// The first out-of-range token (too large or negative) is named with its position, as the CPU
// names it, at the host's next wait (a deferred check: the calls themselves never wait); the
// backward gives it no gradient (the other tokens get theirs).
TEST_F(EmbeddingCuda, OutOfRangeTokenThrowsNamingItAtTheNextWait) {
  const int64_t vocab = 50, dim = 8;
  const auto table = test::randn(size_t(vocab * dim), 3);
  const Dev dt = dev(table);
  const std::vector<int32_t> tok = {3, 5, 99, 2, -4, 50};
  const Tensor dtok = test::to_device_i32(tok);
  const int64_t n = int64_t(tok.size());
  const Dev dout = nan_dev(n * dim);
  const auto waits = test::host_wait_count;
  const uint64_t before = waits();
  cuda::embedding_forward(dtok.data<int32_t>(), n, dt.f(), vocab, dim, dout.f());
  EXPECT_EQ(waits(), before) << "embedding_forward waited for the stream";
  test::expect_error([&] { cuda::synchronize("the test's wait"); },
                     {"embedding_forward", "token id 99", "position 2", "[0, 50)"});
  // Raised once: the next wait is clean.
  cuda::synchronize("the test's wait");
  // The negative one alone (raised by a copy to the host, which waits); the last one (== vocab)
  // alone.
  cuda::embedding_forward(dtok.data<int32_t>() + 3, 3, dt.f(), vocab, dim, dout.f());
  test::expect_error([&] { (void)dout.host(); }, {"token id -4", "position 1"});
  cuda::embedding_forward(dtok.data<int32_t>() + 5, 1, dt.f(), vocab, dim, dout.f());
  test::expect_error([&] { cuda::synchronize("the test's wait"); }, {"token id 50", "position 0"});
  // Two bad calls before one wait: the first call's error.
  cuda::embedding_forward(dtok.data<int32_t>() + 4, 2, dt.f(), vocab, dim, dout.f());
  cuda::embedding_forward(dtok.data<int32_t>() + 2, 1, dt.f(), vocab, dim, dout.f());
  test::expect_error([&] { cuda::synchronize("the test's wait"); }, {"token id -4", "position 0"});
  const auto grad = test::randn(size_t(n * dim), 4);
  const Dev dgrad = dev(grad), dtable = dev(table);
  const uint64_t before_bwd = waits();
  cuda::embedding_backward(dtok.data<int32_t>(), n, dgrad.f(), vocab, dim, dtable.f());
  EXPECT_EQ(waits(), before_bwd) << "embedding_backward waited for the stream";
  test::expect_error([&] { cuda::synchronize("the test's wait"); },
                     {"embedding_backward", "token id 99", "position 2"});
  // The tokens in range got their gradient, in the CPU's order; the bad ones none.
  auto want = table;
  cpu::embedding_backward_range(tok.data(), n, grad.data(), 0, vocab, dim, want.data());
  EXPECT_TRUE(same_bits(dtable.host(), want)) << "the gradient of the tokens in range";
  // The stream is usable after the error: a valid call goes through.
  cuda::embedding_forward(dtok.data<int32_t>(), 2, dt.f(), vocab, dim, dout.f());
  const auto got = dout.host();
  EXPECT_EQ(std::memcmp(got.data(), table.data() + 3 * dim, dim * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got.data() + dim, table.data() + 5 * dim, dim * sizeof(float)), 0);
}

// dtable += the rows of dout, per table row in position order from what dtable held: the CPU's
// serial additions in the CPU's order, so the same bits (checked), and within 1e-6 relative
// (what the contract asks). Two runs from the same start: the same bits. Zipf tokens (many
// repeats), one token throughout (a single run of all n positions; n is and is not a multiple of
// the 4 rows the kernel loads at a time), and unaligned pointers (the scalar path).
TEST_F(EmbeddingCuda, BackwardIsDeterministicAndMatchesCpu) {
  for (const Sizes& s : kShapes) {
    for (const int64_t off : {0, 1}) {
      for (const bool one_token : {false, true}) {
        SCOPED_TRACE(s.name() + " offset " + std::to_string(off) +
                     (one_token ? " one token" : " zipf"));
        auto tok = test::random_tokens(s.n, s.vocab, 5);
        if (one_token) tok.assign(tok.size(), int32_t(s.vocab / 2));
        if (s.n == 9000 && !one_token) {  // more runs than embedding.cu's 2048 blocks
          ASSERT_GT(std::set<int32_t>(tok.begin(), tok.end()).size(), 2048u);
        }
        const auto grad = test::randn(size_t(s.n * s.dim), 6);
        const auto init = test::randn(size_t(s.vocab * s.dim), 7);
        auto want = init;
        cpu::embedding_backward(tok.data(), s.n, grad.data(), s.vocab, s.dim, want.data());
        const Tensor dtok = test::to_device_i32(tok);
        const Dev dgrad = dev(grad, off);
        std::vector<float> first;
        for (int run = 0; run < 2; ++run) {
          const Dev dtable = dev(init, off);
          cuda::embedding_backward(dtok.data<int32_t>(), s.n, dgrad.f(), s.vocab, s.dim,
                                   dtable.f());
          const auto got = dtable.host();
          EXPECT_LE(test::rel_l2(got, want), 1e-6);
          EXPECT_TRUE(same_bits(got, want)) << "not the CPU's serial sums";
          if (run == 0)
            first = got;
          else
            EXPECT_TRUE(same_bits(got, first)) << "two runs differ";
        }
      }
    }
  }
}

// The vocabulary-range variants (a table split by rows across ranks): tokens below, inside and
// above [v0, v0 + rows); out of range: zero rows, no gradient, no error.
TEST_F(EmbeddingCuda, RangeVariantsMatchCpu) {
  for (const Sizes& s : std::vector<Sizes>{{37, 300, 288}, {2048, 301, 50}, {64, 3000, 2048}}) {
    SCOPED_TRACE(s.name());
    const int64_t v0 = s.vocab / 3, rows = s.vocab / 3;
    const auto table = test::randn(size_t(rows * s.dim), 8);
    auto tok = test::random_tokens(s.n, s.vocab, 9);
    tok[0] = -1;  // below every range
    const std::vector<float> grad = test::randn(size_t(s.n * s.dim), 10);
    const auto init = test::randn(size_t(rows * s.dim), 11);
    std::vector<float> out(size_t(s.n * s.dim));
    cpu::embedding_forward_range(tok.data(), s.n, table.data(), v0, rows, s.dim, out.data());
    auto want = init;
    cpu::embedding_backward_range(tok.data(), s.n, grad.data(), v0, rows, s.dim, want.data());
    const Tensor dtok = test::to_device_i32(tok);
    const Dev dt = dev(table), dout = nan_dev(s.n * s.dim), dgrad = dev(grad), dtable = dev(init);
    cuda::embedding_forward_range(dtok.data<int32_t>(), s.n, dt.f(), v0, rows, s.dim, dout.f());
    EXPECT_TRUE(same_bits(dout.host(), out)) << "forward";
    cuda::embedding_backward_range(dtok.data<int32_t>(), s.n, dgrad.f(), v0, rows, s.dim,
                                   dtable.f());
    const auto got = dtable.host();
    EXPECT_LE(test::rel_l2(got, want), 1e-6) << "backward";
    EXPECT_TRUE(same_bits(got, want)) << "backward: not the CPU's serial sums";
  }
  // No token in range: zeros, and dtable untouched.
  const std::vector<int32_t> tok = {0, 1, 2};
  const Tensor dtok = test::to_device_i32(tok);
  const Dev dt = dev({1, 2, 3, 4}), dout = nan_dev(3 * 2), dtable = dev({5, 6, 7, 8});
  cuda::embedding_forward_range(dtok.data<int32_t>(), 3, dt.f(), 10, 2, 2, dout.f());
  EXPECT_EQ(dout.host(), std::vector<float>(6, 0.0f));
  cuda::embedding_backward_range(dtok.data<int32_t>(), 3, dout.f(), 10, 2, 2, dtable.f());
  EXPECT_EQ(dtable.host(), (std::vector<float>{5, 6, 7, 8}));
}

TEST_F(EmbeddingCuda, NoTokensAndBadArguments) {
  const Dev t = dev({1, 2}), o = dev({3, 4});
  const Tensor tok = test::to_device_i32({0});
  cuda::embedding_forward(tok.data<int32_t>(), 0, t.f(), 1, 2, o.f());
  cuda::embedding_backward(tok.data<int32_t>(), 0, o.f(), 1, 2, t.f());
  EXPECT_EQ(o.host(), (std::vector<float>{3, 4}));
  EXPECT_EQ(t.host(), (std::vector<float>{1, 2}));
  EXPECT_THROW(cuda::embedding_forward(tok.data<int32_t>(), 1, t.f(), 0, 2, o.f()), Error);
  EXPECT_THROW(cuda::embedding_forward(tok.data<int32_t>(), 1, t.f(), 1, 0, o.f()), Error);
  EXPECT_THROW(cuda::embedding_backward(tok.data<int32_t>(), -1, o.f(), 1, 2, t.f()), Error);
}
