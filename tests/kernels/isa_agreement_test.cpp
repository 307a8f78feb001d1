// The kernel tiers agree with each other: the same inputs through every tier the process may run
// (baseline, avx2, avx512; test::kernel_isas) give results within the tolerances the fp64
// reference tests state. Each tier is within tol of the fp64 reference there, so two tiers are
// within 2 * tol of each other; the bounds below are that sum unless the kernel is exact (then the
// tiers must agree bitwise). Compared against the best tier.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/adamw.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_decode.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/rope.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// f() once per tier; element i is the result of test::kernel_isas()[i].
template <class F>
auto per_tier(F f) {
  std::vector<decltype(f())> out;
  test::for_each_isa([&](cpu::Isa) { out.push_back(f()); });
  return out;
}

std::string tier(size_t i) {
  return cpu::isa_name(test::kernel_isas()[i]);
}

// Every tier's vectors against the best tier's: relative L2 below tol.
void expect_close(const std::vector<std::vector<float>>& r, double tol, const char* what) {
  for (size_t i = 0; i + 1 < r.size(); ++i)
    EXPECT_LT(test::rel_l2(r[i], r.back()), tol)
        << what << ": " << tier(i) << " vs " << tier(r.size() - 1);
}

void expect_bitwise(const std::vector<std::vector<float>>& r, const char* what) {
  for (size_t i = 0; i + 1 < r.size(); ++i) {
    ASSERT_EQ(r[i].size(), r.back().size());
    EXPECT_EQ(std::memcmp(r[i].data(), r.back().data(), r[i].size() * sizeof(float)), 0)
        << what << ": " << tier(i) << " vs " << tier(r.size() - 1);
  }
}

}  // namespace

// swiglu_test: 1e-6 relative L2 forward and 1e-5 backward against fp64.
TEST(IsaAgreement, SwiGLU) {
  const int64_t rows = 13, F = 771;  // F not a multiple of 4, 8 or 16
  auto gu = test::randn(static_cast<size_t>(rows * 2 * F), 1, 4.0f);
  auto dh = test::randn(static_cast<size_t>(rows * F), 2);
  auto fwd = per_tier([&] {
    std::vector<float> h(static_cast<size_t>(rows * F));
    cpu::swiglu_forward(gu.data(), rows, F, h.data());
    return h;
  });
  auto bwd = per_tier([&] {
    std::vector<float> d(gu.size());
    cpu::swiglu_backward(dh.data(), gu.data(), rows, F, d.data());
    return d;
  });
  expect_close(fwd, 2e-6, "forward");
  expect_close(bwd, 2e-5, "backward");
}

// rmsnorm_test: 1e-6 forward (y and rstd), 1e-5 backward (dx, dw).
TEST(IsaAgreement, RMSNorm) {
  const int64_t rows = 37, dim = 515;
  auto x = test::randn(static_cast<size_t>(rows * dim), 3),
       w = test::randn(static_cast<size_t>(dim), 4);
  auto dy = test::randn(x.size(), 5);
  auto r = per_tier([&] {
    std::vector<float> y(x.size()), rstd(static_cast<size_t>(rows)), dx(x.size(), 0.0f),
        dw(static_cast<size_t>(dim), 0.0f);
    cpu::rmsnorm_forward(x.data(), w.data(), rows, dim, 1e-5f, y.data(), rstd.data());
    cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                          dw.data());
    return std::vector<std::vector<float>>{y, rstd, dx, dw};
  });
  const char* names[] = {"y", "rstd", "dx", "dw"};
  const double tols[] = {2e-6, 2e-6, 2e-5, 2e-5};
  for (size_t k = 0; k < 4; ++k) {
    std::vector<std::vector<float>> part;
    for (const auto& t : r) part.push_back(t[k]);
    expect_close(part, tols[k], names[k]);
  }
}

// RoPE is a table lookup and two products per element: rope_test holds each tier to 2e-6
// absolute of fp64.
TEST(IsaAgreement, Rope) {
  const int64_t B = 2, T = 19, H = 3, D = 48, stride = H * D + 5;
  const auto table = cpu::rope_table(D, 64, 10000.0, {});
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = int32_t(3 * t + 1);
  auto x0 = test::randn(static_cast<size_t>(B * T * stride), 6);
  auto r = per_tier([&] {
    auto x = x0;
    cpu::rope_forward(x.data(), B, T, H, D, stride, pos.data(), table);
    return x;
  });
  for (size_t i = 0; i + 1 < r.size(); ++i)
    EXPECT_LT(test::max_abs_diff(r[i], r.back()), 4e-6) << tier(i);
}

// Embedding is gathers and sums in a fixed order, so exact: bitwise equal on every tier.
TEST(IsaAgreement, EmbeddingIsBitwise) {
  const int64_t n = 301, vocab = 53, dim = 77;
  auto tokens = test::random_tokens(n, vocab, 7);
  auto table = test::randn(static_cast<size_t>(vocab * dim), 8),
       dout = test::randn(static_cast<size_t>(n * dim), 9);
  auto fwd = per_tier([&] {
    std::vector<float> out(static_cast<size_t>(n * dim));
    cpu::embedding_forward(tokens.data(), n, table.data(), vocab, dim, out.data());
    return out;
  });
  auto bwd = per_tier([&] {
    std::vector<float> dt(table.size(), 0.0f);
    cpu::embedding_backward(tokens.data(), n, dout.data(), vocab, dim, dt.data());
    return dt;
  });
  expect_bitwise(fwd, "embedding_forward");
  expect_bitwise(bwd, "embedding_backward");
}

// The casts round to nearest even on every tier (cast_test: bitwise against the scalar reference),
// scale/add are one IEEE operation per element, and sum_squares is within 1e-12 of the exact sum.
TEST(IsaAgreement, CastsAndReductions) {
  const int64_t n = 10007;
  auto x = test::randn(static_cast<size_t>(n), 10, 30.0f),
       y = test::randn(static_cast<size_t>(n), 11);
  auto r = per_tier([&] {
    std::vector<bf16> b(static_cast<size_t>(n));
    cpu::cast_f32_to_bf16(x.data(), b.data(), n);
    std::vector<float> back(static_cast<size_t>(n)), s = x, a = y;
    cpu::cast_bf16_to_f32(b.data(), back.data(), n);
    cpu::scale_inplace(s.data(), n, 0.3f);
    cpu::add_inplace(a.data(), x.data(), n);
    return std::vector<std::vector<float>>{back, s, a};
  });
  for (size_t k = 0; k < 3; ++k) {
    std::vector<std::vector<float>> part;
    for (const auto& t : r) part.push_back(t[k]);
    expect_bitwise(part, k == 0 ? "bf16 round trip" : k == 1 ? "scale_inplace" : "add_inplace");
  }
  std::vector<double> ss = per_tier([&] { return cpu::sum_squares(x.data(), n); });
  for (size_t i = 0; i + 1 < ss.size(); ++i)
    EXPECT_NEAR(ss[i], ss.back(), 2e-12 * ss.back()) << tier(i);
}

// adamw_test: parameters within 1e-6 absolute (size ~1) of fp64 after each step, moments 1e-5
// relative; so tiers agree to 2e-6 and 2e-5 relative L2.
TEST(IsaAgreement, AdamW) {
  const int64_t n = 1027;
  auto p0 = test::randn(static_cast<size_t>(n), 12), g = test::randn(static_cast<size_t>(n), 13);
  cpu::AdamWArgs a{.lr = 1e-2f, .weight_decay = 0.1f, .step = 3};
  auto r = per_tier([&] {
    auto p = p0;
    std::vector<float> m(static_cast<size_t>(n), 0.01f), v(static_cast<size_t>(n), 0.02f);
    for (int step = 0; step < 3; ++step)
      cpu::adamw_step(a, p.data(), g.data(), m.data(), v.data(), n);
    return std::vector<std::vector<float>>{p, m, v};
  });
  for (size_t k = 0; k < 3; ++k) {
    std::vector<std::vector<float>> part;
    for (const auto& t : r) part.push_back(t[k]);
    expect_close(part, k == 0 ? 2e-6 : 2e-5, k == 0 ? "param" : k == 1 ? "m" : "v");
  }
}

// cross_entropy_test: loss within 1e-5 relative of fp64, dx and dw within 1e-5 relative L2.
TEST(IsaAgreement, LinearCrossEntropyF32) {
  const int64_t N = 37, D = 20, V = 333;
  auto x = test::randn(static_cast<size_t>(N * D), 14),
       w = test::randn(static_cast<size_t>(V * D), 15, 0.5f);
  auto t = test::random_tokens(N, V, 16);
  t[3] = -1;
  auto r = per_tier([&] {
    std::vector<float> dx(x.size()), dw(w.size(), 0.0f);
    const double loss = cpu::linear_cross_entropy({.x = x.data(),
                                                   .w = w.data(),
                                                   .targets = t.data(),
                                                   .N = N,
                                                   .D = D,
                                                   .V = V,
                                                   .grad_scale = 1.0f / float(N),
                                                   .dx = dx.data(),
                                                   .dw = dw.data(),
                                                   .chunk_rows = 8});
    return std::vector<std::vector<float>>{{float(loss)}, dx, dw};
  });
  const char* names[] = {"loss", "dx", "dw"};
  for (size_t k = 0; k < 3; ++k) {
    std::vector<std::vector<float>> part;
    for (const auto& tt : r) part.push_back(tt[k]);
    expect_close(part, 2e-5, names[k]);
  }
}

// attention_test: forward 3e-6 relative L2 (lse 3e-6 absolute), backward 1e-5; head dims that
// are and are not multiples of the vector widths, T with a partial tile, GQA.
TEST(IsaAgreement, Attention) {
  struct Dims {
    int64_t B, T, Hq, Hkv, D;
  };
  for (const Dims d : {Dims{1, 37, 4, 2, 20}, Dims{1, 70, 2, 1, 48}, Dims{1, 33, 2, 2, 128},
                       Dims{2, 19, 2, 1, 16}}) {
    const cpu::AttentionShape s{d.B, d.T,        d.Hq,        d.Hkv,
                                d.D, d.Hq * d.D, d.Hkv * d.D, 1.0f / std::sqrt(float(d.D))};
    const size_t nq = static_cast<size_t>(d.B * d.T * d.Hq * d.D),
                 nkv = static_cast<size_t>(d.B * d.T * d.Hkv * d.D);
    auto q = test::randn(nq, 17), k = test::randn(nkv, 18), v = test::randn(nkv, 19);
    auto dout = test::randn(nq, 20);
    auto r = per_tier([&] {
      std::vector<float> out(nq), lse(static_cast<size_t>(d.B * d.Hq * d.T)), dq(nq), dk(nkv),
          dv(nkv);
      cpu::attention_forward(s, q.data(), k.data(), v.data(), out.data(), lse.data());
      cpu::attention_backward(s, q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
                              dq.data(), dk.data(), dv.data());
      return std::vector<std::vector<float>>{out, lse, dq, dk, dv};
    });
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    SCOPED_TRACE("T=" + std::to_string(d.T) + " D=" + std::to_string(d.D));
    for (size_t kk = 0; kk < 5; ++kk) {
      std::vector<std::vector<float>> part;
      for (const auto& t : r) part.push_back(t[kk]);
      if (kk == 1) {
        for (size_t i = 0; i + 1 < part.size(); ++i)
          EXPECT_LT(test::max_abs_diff(part[i], part.back()), 6e-6) << "lse " << tier(i);
      } else {
        expect_close(part, kk == 0 ? 6e-6 : 2e-5, names[kk]);
      }
    }
  }
}

// attention_decode_test: 2e-6 relative L2 against fp64.
TEST(IsaAgreement, AttentionDecode) {
  cpu::DecodeShape s;
  s.Tq = 3;
  s.L = 131;
  s.Hq = 8;
  s.Hkv = 2;
  s.D = 40;
  s.q_stride = s.Hq * s.D + 1;
  s.kv_stride = s.Hkv * s.D + 3;
  s.scale = 1.0f / std::sqrt(float(s.D));
  auto q = test::randn(static_cast<size_t>(s.Tq * s.q_stride), 21),
       k = test::randn(static_cast<size_t>(s.L * s.kv_stride), 22),
       v = test::randn(static_cast<size_t>(s.L * s.kv_stride), 23);
  auto r = per_tier([&] {
    std::vector<float> out(static_cast<size_t>(s.Tq * s.Hq * s.D));
    cpu::attention_decode(s, q.data(), k.data(), v.data(), out.data());
    return out;
  });
  expect_close(r, 4e-6, "attention_decode");
}
