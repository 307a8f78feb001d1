// The ops on cuda tensors against the same ops on cpu tensors (ops/cuda/cuda_backend.cpp against
// ops/cpu_backend.cpp): the dispatch, the tensors' strides and dtypes, the host data copied per
// call, the weight gradient's first write, the op profile's GPU timing, and the error of an op
// without a CUDA kernel. Skipped without a GPU (LOOM_REQUIRE_GPU=1 fails instead).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "ops/ops.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

namespace loom {
namespace {

Tensor random(const Shape& s, uint64_t seed, DType dt = DType::f32) {
  Tensor t = Tensor::empty(s, DType::f32);
  const auto v = test::randn(size_t(t.numel()), seed);
  std::memcpy(t.raw(), v.data(), t.nbytes());
  return dt == DType::f32 ? t : t.to(dt);
}
Tensor on_gpu(const Tensor& h) {
  Tensor d = Tensor::empty(h.shape(), h.dtype(), Device::cuda);
  d.copy_from(h);
  return d;
}
// A NaN-filled pair of the same shape: the CPU's and the GPU's output.
std::pair<Tensor, Tensor> outputs(const Shape& s, DType dt = DType::f32) {
  Tensor h = Tensor::empty(s, DType::f32);
  for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = NAN;
  if (dt == DType::bf16) h = h.to(DType::bf16);
  return {h, on_gpu(h)};
}
std::vector<float> values(const Tensor& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  h.copy_from(t);
  if (h.dtype() == DType::bf16) h = h.to(DType::f32);
  const float* p = h.data<float>();
  return std::vector<float>(p, p + h.numel());
}
void expect_close(const Tensor& cpu, const Tensor& gpu, double tol, const char* what) {
  const std::vector<float> a = values(cpu), b = values(gpu);
  for (size_t i = 0; i < b.size(); ++i) ASSERT_FALSE(std::isnan(b[i])) << what << " [" << i << "]";
  EXPECT_LE(test::rel_l2(b, a), tol) << what;
}

class OpsCuda : public test::CudaTest {};

TEST_F(OpsCuda, LinearFormsAndTheFirstWriteOfAWeightGradient) {
  const int64_t M = 37, K = 48, N = 72;
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor x = random({M, K}, 1, dt), w = random({N, K}, 2, dt), r = random({M, N}, 3);
    Tensor gx = on_gpu(x), gw = on_gpu(w), gr = on_gpu(r);
    auto [y, gy] = outputs({M, N});
    ops::linear(x, w, y);
    ops::linear(gx, gw, gy);
    expect_close(y, gy, 1e-5, "linear");
    ops::linear(x, w, y, true);
    ops::linear(gx, gw, gy, true);
    expect_close(y, gy, 1e-5, "linear accumulated");
    auto [y16, gy16] = outputs({M, N}, DType::bf16);
    ops::linear(x, w, y16);
    ops::linear(gx, gw, gy16);
    expect_close(y16, gy16, 4e-3, "linear rounded to bf16");
    auto [yr, gyr] = outputs({M, N});
    ops::linear(x, w, r, yr);
    ops::linear(gx, gw, gr, gyr);
    expect_close(yr, gyr, 1e-5, "linear with a residual");
    // The backward: dx, and dw written on its first write (NaN before: never read), then added.
    Tensor dy = random({M, N}, 4, dt), gdy = on_gpu(dy);
    auto [dx, gdx] = outputs({M, K});
    auto [dw, gdw] = outputs({N, K});
    uint8_t flag = 1, gflag = 1;
    ops::linear_backward(dy, x, w, ops::WeightGrad(dw, {&flag, 1}), dx);
    ops::linear_backward(gdy, gx, gw, ops::WeightGrad(gdw, {&gflag, 1}), gdx);
    EXPECT_EQ(gflag, 0);
    expect_close(dx, gdx, 1e-5, "linear_backward dx");
    expect_close(dw, gdw, 1e-5, "linear_backward dw written");
    ops::linear_backward(dy, x, w, ops::WeightGrad(dw, {&flag, 1}), dx);
    ops::linear_backward(gdy, gx, gw, ops::WeightGrad(gdw, {&gflag, 1}), gdx);
    expect_close(dw, gdw, 1e-5, "linear_backward dw added");
  }
}

TEST_F(OpsCuda, NormSwiGluRopeEmbedding) {
  const int64_t B = 2, T = 9, H = 4, D = 64, rows = B * T;
  Tensor x = random({rows, H * D}, 1), w = random({H * D}, 2), gx = on_gpu(x), gw = on_gpu(w);
  auto [y, gy] = outputs({rows, H * D});
  auto [rs, grs] = outputs({rows});
  ops::rmsnorm_forward(x, w, 1e-5f, y, rs);
  ops::rmsnorm_forward(gx, gw, 1e-5f, gy, grs);
  expect_close(y, gy, 1e-5, "rmsnorm_forward");
  Tensor dy = random({rows, H * D}, 3), gdy = on_gpu(dy);
  Tensor dx = Tensor::zeros({rows, H * D}, DType::f32), dw = Tensor::zeros({H * D}, DType::f32);
  Tensor gdx = on_gpu(dx), gdwn = on_gpu(dw);
  ops::rmsnorm_backward(dy, x, w, rs, dx, dw);
  ops::rmsnorm_backward(gdy, gx, gw, grs, gdx, gdwn);
  expect_close(dx, gdx, 1e-5, "rmsnorm_backward dx");
  expect_close(dw, gdwn, 1e-5, "rmsnorm_backward dw");

  Tensor gu = random({rows, 2 * D}, 4), ggu = on_gpu(gu);
  auto [act, gact] = outputs({rows, D});
  ops::swiglu_forward(gu, act);
  ops::swiglu_forward(ggu, gact);
  expect_close(act, gact, 1e-5, "swiglu_forward");
  auto [dgu, gdgu] = outputs({rows, 2 * D});
  Tensor dact = random({rows, D}, 5), gdact = on_gpu(dact);
  ops::swiglu_backward(dact, gu, dgu);
  ops::swiglu_backward(gdact, ggu, gdgu);
  expect_close(dgu, gdgu, 1e-5, "swiglu_backward");

  // RoPE at positions that do not start at 0 (a later chunk), on q inside a fused qkv buffer.
  const RopeTable table = ops::rope_table(D, 64, 500000.0, RopeScaling{});
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(20 + 3 * t);
  Tensor qkv = random({rows, 3 * H * D}, 6), gqkv = on_gpu(qkv);
  Tensor q = qkv.narrow(1, 0, H * D), gq = gqkv.narrow(1, 0, H * D);
  ops::rope_forward(q, B, H, pos, table);
  ops::rope_forward(gq, B, H, pos, table);
  expect_close(qkv, gqkv, 1e-6, "rope_forward (and the columns it must leave)");
  ops::rope_backward(q, B, H, pos, table);
  ops::rope_backward(gq, B, H, pos, table);
  expect_close(qkv, gqkv, 1e-6, "rope_backward");
  auto [qr, gqr] = outputs({rows, 3 * H * D}, DType::bf16);
  ops::rope_rounded(qkv, B, 2 * H, H, pos, table, false, qr);
  ops::rope_rounded(gqkv, B, 2 * H, H, pos, table, false, gqr);
  expect_close(qr, gqr, 4e-3, "rope_rounded");

  const int64_t vocab = 50;
  const std::vector<int32_t> tokens = test::random_tokens(rows, vocab, 7);
  Tensor tab = random({vocab, D}, 8), gtab = on_gpu(tab);
  auto [e, ge] = outputs({rows, D});
  ops::embedding_forward(tokens.data(), tab, e);
  ops::embedding_forward(tokens.data(), gtab, ge);
  expect_close(e, ge, 0, "embedding_forward");
  Tensor de = random({rows, D}, 9), gde = on_gpu(de);
  Tensor dtab = Tensor::zeros({vocab, D}, DType::f32), gdtab = on_gpu(dtab);
  ops::embedding_backward(tokens.data(), de, dtab);
  ops::embedding_backward(tokens.data(), gde, gdtab);
  expect_close(dtab, gdtab, 1e-6, "embedding_backward");
}

TEST_F(OpsCuda, AttentionOnViewsOfAFusedQkv) {
  const int64_t B = 2, T = 33, Hq = 4, Hkv = 2, D = 64, rows = B * T, W = (Hq + 2 * Hkv) * D;
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor qkv = random({rows, W}, 1, dt), gqkv = on_gpu(qkv);
    Tensor q = qkv.narrow(1, 0, Hq * D), k = qkv.narrow(1, Hq * D, Hkv * D),
           v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
    Tensor gq = gqkv.narrow(1, 0, Hq * D), gk = gqkv.narrow(1, Hq * D, Hkv * D),
           gv = gqkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
    auto [out, gout] = outputs({rows, Hq * D}, dt);
    auto [lse, glse] = outputs({B, Hq, T});
    ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse);
    ops::attention_forward(gq, gk, gv, B, Hq, Hkv, gout, glse);
    const double tol = dt == DType::f32 ? 1e-5 : 5e-3;
    expect_close(out, gout, tol, "attention_forward out");
    expect_close(lse, glse, 1e-5, "attention_forward lse");
    Tensor dout = random({rows, Hq * D}, 2), gdout = on_gpu(dout);
    auto [dqkv, gdqkv] = outputs({rows, W});
    Tensor dq = dqkv.narrow(1, 0, Hq * D), dk = dqkv.narrow(1, Hq * D, Hkv * D),
           dv = dqkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
    Tensor gdq = gdqkv.narrow(1, 0, Hq * D), gdk = gdqkv.narrow(1, Hq * D, Hkv * D),
           gdv = gdqkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
    // The GPU's backward from its own forward's out and lse, as a training step runs it.
    ops::attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv);
    ops::attention_backward(gq, gk, gv, gout, glse, gdout, B, Hq, Hkv, gdq, gdk, gdv);
    expect_close(dqkv, gdqkv, dt == DType::f32 ? 1e-5 : 1.5e-2, "attention_backward");
  }
}

TEST_F(OpsCuda, FusedLossReturnsTheCpusLoss) {
  const int64_t N = 40, D = 64, V = 1000;
  Tensor x = random({N, D}, 1), w = random({V, D}, 2), gx = on_gpu(x), gw = on_gpu(w);
  std::vector<int32_t> targets = test::random_tokens(N, V, 3);
  targets[5] = -1;  // ignored
  auto [dx, gdx] = outputs({N, D});
  Tensor dw = Tensor::zeros({V, D}, DType::f32), gdw = on_gpu(dw);
  ops::LinearCrossEntropy a{x, w, dx, ops::WeightGrad(dw), targets.data(), V, 1.0f / 39, 16, 0};
  ops::LinearCrossEntropy g{gx, gw, gdx, ops::WeightGrad(gdw), targets.data(), V, 1.0f / 39, 16, 0};
  const double loss = ops::linear_cross_entropy(a), gloss = ops::linear_cross_entropy(g);
  EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
  expect_close(dx, gdx, 1e-5, "loss dx");
  expect_close(dw, gdw, 1e-5, "loss dw");
}

TEST_F(OpsCuda, ProfileTimesGpuOpsAndAMissingKernelIsNamed) {
  Tensor x = on_gpu(random({64, 64}, 1)), w = on_gpu(random({64, 64}, 2));
  Tensor y = Tensor::empty({64, 64}, DType::f32, Device::cuda);
  std::vector<std::string> seen;
  {
    ops::ProfileOps p([&](const char* op, const std::vector<ops::KernelWork>&, double s) {
      seen.push_back(op);
      EXPECT_GT(s, 0.0);
      EXPECT_LT(s, 1.0);
    });
    ops::linear(x, w, y);
  }
  EXPECT_EQ(seen, std::vector<std::string>{"linear"});
  try {
    ops::attention_decode(x, w, w, 64, 1, 1, y);
    FAIL() << "attention_decode ran on cuda without a kernel";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention_decode: no kernel on device cuda"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace loom
