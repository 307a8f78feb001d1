#include "kernels/cpu/attention_decode.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::cpu::DecodeShape;

namespace {

// fp64 attention of query i (position L - Tq + i) against keys [0, L - Tq + i], straight from
// the definition: softmax(q k^T * scale) v.
std::vector<double> naive_decode(const DecodeShape& s, const std::vector<float>& q,
                                 const std::vector<float>& k, const std::vector<float>& v) {
  const int64_t G = s.Hq / s.Hkv, D = s.D;
  std::vector<double> out(size_t(s.Tq * s.Hq * D), 0.0);
  std::vector<double> sc(size_t(s.L));
  for (int64_t i = 0; i < s.Tq; ++i)
    for (int64_t h = 0; h < s.Hq; ++h) {
      const int64_t last = s.L - s.Tq + i, g = h / G;
      double m = -INFINITY;
      for (int64_t j = 0; j <= last; ++j) {
        double a = 0;
        for (int64_t d = 0; d < D; ++d)
          a += double(q[i * s.q_stride + h * D + d]) * double(k[j * s.kv_stride + g * D + d]);
        sc[j] = a * double(s.scale);
        m = std::max(m, sc[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j <= last; ++j) sum += std::exp(sc[j] - m);
      for (int64_t j = 0; j <= last; ++j) {
        const double p = std::exp(sc[j] - m) / sum;
        for (int64_t d = 0; d < D; ++d)
          out[(i * s.Hq + h) * D + d] += p * double(v[j * s.kv_stride + g * D + d]);
      }
    }
  return out;
}

struct Case {
  int64_t Tq, L, Hq, Hkv, D;
  float qscale;  // larger values make the softmax peaky
};

void check_case(const Case& c, uint64_t seed) {
  DecodeShape s;
  s.Tq = c.Tq;
  s.L = c.L;
  s.Hq = c.Hq;
  s.Hkv = c.Hkv;
  s.D = c.D;
  // Padded strides: the kernel must not assume packed rows.
  s.q_stride = c.Hq * c.D + 5;
  s.kv_stride = c.Hkv * c.D + 3;
  s.scale = 1.0f / std::sqrt(float(c.D));
  auto q = test::randn(size_t(c.Tq * s.q_stride), seed, c.qscale);
  auto k = test::randn(size_t(c.L * s.kv_stride), seed + 1);
  auto v = test::randn(size_t(c.L * s.kv_stride), seed + 2);
  std::vector<float> out(size_t(c.Tq * c.Hq * c.D), NAN);
  cpu::attention_decode(s, q.data(), k.data(), v.data(), out.data());
  const auto ref = naive_decode(s, q, k, v);
  // f32 scores and sums over a few hundred keys carry ~1e-6 relative error; a wrong mask,
  // offset or head mapping changes outputs at the 1e-1 level.
  const double err = test::rel_l2(out, ref);
  EXPECT_LT(err, 2e-6) << "Tq=" << c.Tq << " L=" << c.L << " Hq=" << c.Hq << " Hkv=" << c.Hkv
                       << " D=" << c.D;
  EXPECT_LT(test::max_abs_diff(out, ref), 2e-5)
      << "Tq=" << c.Tq << " L=" << c.L << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D;
}

}  // namespace

TEST_ALL_ISAS(AttentionDecode, MatchesNaiveFp64) {
  const Case cases[] = {
      {1, 1, 1, 1, 16, 1},      // the first token: one key
      {1, 37, 4, 2, 24, 1},     // one new token, D not a multiple of 16
      {1, 300, 8, 4, 64, 3},    // several key tiles, peaky softmax
      {3, 130, 6, 2, 40, 1},    // a few new tokens offset by a past of 127
      {37, 37, 4, 1, 24, 2},    // prefill (no past), several row blocks, multi-query
      {20, 90, 32, 1, 8, 1},    // a group wider than one row block
      {5, 64, 2, 2, 7, 1},      // odd head dim, no grouping, L at a tile boundary
      {2, 129, 64, 8, 128, 1},  // Llama-3 head dim, 8 heads per kv head
      {4, 50, 4, 4, 96, 1},     // head dim 96
      {2, 20, 2, 1, 200, 2},    // a head dim beyond the unrolled cases, with a tail
  };
  uint64_t seed = 100;
  for (const Case& c : cases) check_case(c, seed += 10);
}

TEST_ALL_ISAS(AttentionDecode, NoPastEqualsFlashForward) {
  // With no past, the decode kernel computes what training's attention computes.
  const int64_t T = 71, Hq = 8, Hkv = 2, D = 48;
  const int64_t qs = (Hq + 2 * Hkv) * D;
  auto qkv = test::randn(size_t(T * qs), 5);
  cpu::AttentionShape a{1, T, Hq, Hkv, D, qs, qs, 1.0f / std::sqrt(float(D))};
  std::vector<float> ref(size_t(T * Hq * D)), lse(size_t(Hq * T)), out(ref.size());
  const float* q = qkv.data();
  cpu::attention_forward(a, q, q + Hq * D, q + (Hq + Hkv) * D, ref.data(), lse.data());
  DecodeShape s{T, T, Hq, Hkv, D, qs, qs, a.scale};
  cpu::attention_decode(s, q, q + Hq * D, q + (Hq + Hkv) * D, out.data());
  EXPECT_LT(test::rel_l2(out, ref), 2e-6);
}

TEST_ALL_ISAS(AttentionDecode, IncrementalEqualsAllAtOnce) {
  // Feeding the queries one at a time (L growing) gives the rows of the all-at-once result.
  const int64_t T = 45, Hq = 4, Hkv = 2, D = 32, past = 10;
  DecodeShape all{T, past + T, Hq, Hkv, D, Hq * D, Hkv * D, 0.17f};
  auto q = test::randn(size_t(T * Hq * D), 9);
  auto k = test::randn(size_t((past + T) * Hkv * D), 10);
  auto v = test::randn(size_t((past + T) * Hkv * D), 11);
  std::vector<float> ref(size_t(T * Hq * D)), one(size_t(Hq * D));
  cpu::attention_decode(all, q.data(), k.data(), v.data(), ref.data());
  double worst = 0;
  for (int64_t i = 0; i < T; ++i) {
    DecodeShape s = all;
    s.Tq = 1;
    s.L = past + i + 1;
    cpu::attention_decode(s, q.data() + i * Hq * D, k.data(), v.data(), one.data());
    for (int64_t e = 0; e < Hq * D; ++e)
      worst = std::max(worst, double(std::abs(one[e] - ref[i * Hq * D + e])));
  }
  EXPECT_LT(worst, 1e-6);
}

TEST(AttentionDecode, RejectsBadShapes) {
  std::vector<float> x(4096, 1.0f), out(4096);
  DecodeShape s{2, 1, 2, 1, 8, 16, 8, 1.0f};  // Tq > L
  EXPECT_THROW(cpu::attention_decode(s, x.data(), x.data(), x.data(), out.data()), Error);
  s = {1, 4, 3, 2, 8, 24, 16, 1.0f};  // Hq not a multiple of Hkv
  EXPECT_THROW(cpu::attention_decode(s, x.data(), x.data(), x.data(), out.data()), Error);
  s = {1, 4, 2, 1, 8, 8, 8, 1.0f};  // q_stride < Hq*D
  EXPECT_THROW(cpu::attention_decode(s, x.data(), x.data(), x.data(), out.data()), Error);
  s = {0, 4, 2, 1, 8, 16, 8, 1.0f};  // nothing to do
  EXPECT_NO_THROW(cpu::attention_decode(s, x.data(), x.data(), x.data(), out.data()));
}

TEST(AttentionDecode, Timing) {
  // One decode step at bench-small shapes (8 heads, 4 kv heads, head dim 64) with 2048 cached
  // positions; informational.
  const int64_t L = 2048, Hq = 8, Hkv = 4, D = 64;
  DecodeShape s{1, L, Hq, Hkv, D, Hq * D, Hkv * D, 0.125f};
  auto q = test::randn(size_t(Hq * D), 1);
  auto k = test::randn(size_t(L * Hkv * D), 2);
  auto v = test::randn(size_t(L * Hkv * D), 3);
  std::vector<float> out(size_t(Hq * D));
  double best = 1e9;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    cpu::attention_decode(s, q.data(), k.data(), v.data(), out.data());
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("attention_decode Tq=1 L=%ld Hq=%ld Hkv=%ld D=%ld: %.1f us\n", long(L), long(Hq),
              long(Hkv), long(D), best * 1e6);
}
