// The CUDA decode attention (kernels/cuda/attention_decode.hpp) against the CPU kernel
// (kernels/cpu/attention_decode.hpp) and fp64: random queries and cache (never zeros), padded
// strides, the output filled with NaN first, one and several new queries, caches of 1 key, one
// chunk's worth and partial chunks past it (up to 5000 keys), GQA and not, head dims 40, 64, 128
// and 256, and peaky softmaxes (queries scaled by 4). f32 within 1e-5 relative L2 of the CPU's.
#include "kernels/cuda/attention_decode.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/attention_decode.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using cpu::DecodeShape;

namespace {

constexpr double kTol = 1e-5;

struct Case {
  int64_t Tq, L, Hq, Hkv, D;
  float qscale;
};

class AttentionDecodeCuda : public test::CudaTest {};

TEST_F(AttentionDecodeCuda, MatchesCpu) {
  const Case cases[] = {
      {1, 1, 4, 2, 64, 1},    {1, 256, 4, 2, 64, 1},   {1, 257, 4, 4, 128, 1},
      {3, 77, 4, 2, 40, 1},   {1, 5000, 32, 8, 64, 1}, {2, 1030, 32, 8, 128, 4},
      {4, 600, 8, 1, 256, 1}, {1, 300, 2, 2, 64, 4},
  };
  uint64_t seed = 11;
  for (const Case& c : cases) {
    const std::string what = "Tq=" + std::to_string(c.Tq) + " L=" + std::to_string(c.L) +
                             " Hq=" + std::to_string(c.Hq) + " Hkv=" + std::to_string(c.Hkv) +
                             " D=" + std::to_string(c.D);
    SCOPED_TRACE(what);
    DecodeShape s{
        c.Tq, c.L, c.Hq, c.Hkv, c.D, c.Hq * c.D + 8, c.Hkv * c.D + 4, 1.0f / std::sqrt(float(c.D))};
    const auto q = test::randn(size_t(s.Tq * s.q_stride), seed++, c.qscale);
    const auto k = test::randn(size_t(s.L * s.kv_stride), seed++);
    const auto v = test::randn(size_t(s.L * s.kv_stride), seed++);
    std::vector<float> want(size_t(s.Tq * s.Hq * s.D));
    cpu::attention_decode(s, q.data(), k.data(), v.data(), want.data());
    const Tensor dq = test::to_device(q), dk = test::to_device(k), dv = test::to_device(v);
    const Tensor out = test::nan_device(int64_t(want.size()));
    cuda::attention_decode(s, dq.data<float>(), dk.data<float>(), dv.data<float>(),
                           out.data<float>());
    EXPECT_LE(test::rel_l2(test::to_host(out), want), kTol);
  }
}

TEST(AttentionDecodeCudaHost, BadArgumentsThrowBeforeTheDevice) {
  const DecodeShape s{1, 8, 4, 2, 64, 256, 128, 0.125f};
  DecodeShape bad = s;
  bad.L = 0;
  test::expect_error([&] { cuda::attention_decode(bad, nullptr, nullptr, nullptr, nullptr); },
                     {"attention_decode", "L >= Tq"});
  bad = s;
  bad.Hkv = 3;
  test::expect_error([&] { cuda::attention_decode(bad, nullptr, nullptr, nullptr, nullptr); },
                     {"attention_decode", "multiple of Hkv"});
  bad = s;
  bad.D = 1024;
  bad.q_stride = 4096;
  bad.kv_stride = 2048;
  test::expect_error([&] { cuda::attention_decode(bad, nullptr, nullptr, nullptr, nullptr); },
                     {"attention_decode", "head dim 1024"});
  bad = s;
  bad.kv_stride = 100;
  test::expect_error([&] { cuda::attention_decode(bad, nullptr, nullptr, nullptr, nullptr); },
                     {"attention_decode", "kv_stride"});
  test::expect_error([&] { cuda::attention_decode(s, nullptr, nullptr, nullptr, nullptr); },
                     {"attention_decode", "null pointer"});
}

}  // namespace
