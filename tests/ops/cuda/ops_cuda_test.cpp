// The ops on cuda tensors against the same ops on cpu tensors (ops/cuda/cuda_backend.cpp against
// ops/cpu_backend.cpp): the dispatch, the tensors' strides and dtypes, the index arrays and the
// loss on the device, the meta run's model of the GPU's scratch, the weight gradient's first write,
// a mixture-of-experts layer's ops in the model's order and Qwen2-MoE's biases and gate, the op
// profile's GPU timing, and the error of an op without a kernel. Skipped without a GPU
// (LOOM_REQUIRE_GPU=1 fails instead).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "ops/backend.hpp"
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
  // The positions and the table on each device (the GPU's table a device copy, made once).
  const ops::Rope table = ops::rope_table(D, 64, 500000.0, RopeScaling{});
  const ops::Rope gtable = ops::rope_table(D, 64, 500000.0, RopeScaling{}, Device::cuda);
  std::vector<int32_t> at(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) at[size_t(t)] = int32_t(20 + 3 * t);
  const Tensor pos = ops::index_tensor(at, Device::cpu, "position", 0, 64);
  const Tensor gpos = ops::index_tensor(at, Device::cuda, "position", 0, 64);
  Tensor qkv = random({rows, 3 * H * D}, 6), gqkv = on_gpu(qkv);
  Tensor q = qkv.narrow(1, 0, H * D), gq = gqkv.narrow(1, 0, H * D);
  ops::rope_forward(q, B, H, pos, table);
  ops::rope_forward(gq, B, H, gpos, gtable);
  expect_close(qkv, gqkv, 1e-6, "rope_forward (and the columns it must leave)");
  ops::rope_backward(q, B, H, pos, table);
  ops::rope_backward(gq, B, H, gpos, gtable);
  expect_close(qkv, gqkv, 1e-6, "rope_backward");
  auto [qr, gqr] = outputs({rows, 3 * H * D}, DType::bf16);
  ops::rope_rounded(qkv, B, 2 * H, H, pos, table, false, qr);
  ops::rope_rounded(gqkv, B, 2 * H, H, gpos, gtable, false, gqr);
  expect_close(qr, gqr, 4e-3, "rope_rounded");

  const int64_t vocab = 50;
  const std::vector<int32_t> ids = test::random_tokens(rows, vocab, 7);
  const Tensor tokens = ops::index_tensor(ids, Device::cpu, "token", 0, vocab);
  const Tensor gtokens = ops::index_tensor(ids, Device::cuda, "token", 0, vocab);
  Tensor tab = random({vocab, D}, 8), gtab = on_gpu(tab);
  auto [e, ge] = outputs({rows, D});
  ops::embedding_forward(tokens, tab, e);
  ops::embedding_forward(gtokens, gtab, ge);
  expect_close(e, ge, 0, "embedding_forward");
  Tensor de = random({rows, D}, 9), gde = on_gpu(de);
  Tensor dtab = Tensor::zeros({vocab, D}, DType::f32), gdtab = on_gpu(dtab);
  ops::embedding_backward(tokens, de, dtab);
  ops::embedding_backward(gtokens, gde, gdtab);
  expect_close(dtab, gdtab, 1e-6, "embedding_backward");
}

// The gradient norm's sums on the device, read back once: each within a rounding of the CPU's
// (both in double, in different orders).
TEST_F(OpsCuda, SumsOfSquaresInOneRead) {
  const std::vector<Tensor> xs{random({33, 17}, 1), random({1}, 2), random({70000}, 3)};
  std::vector<Tensor> gxs;
  for (const Tensor& x : xs) gxs.push_back(on_gpu(x));
  const std::vector<double> want = ops::sum_squares_each(xs), got = ops::sum_squares_each(gxs);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-12 * want[i]) << i;
    EXPECT_EQ(got[i], ops::sum_squares(gxs[i])) << i;
  }
}

// What a call takes from the GPU's caching allocator beyond its tensors is what a meta run that
// models the GPU books for it (ops::ModeledDevice, kernels/cuda/scratch.hpp): the planner's peak
// is the GPU's. The GEMM workspace exists already on both sides (booked by a first GEMM).
// The peak's rise over what is allocated just before the call, from an empty cache: the caching
// allocator hands out a cached block up to 25% larger than asked for and books its size, so the
// same call books more after other work left such blocks (seen on the CUDA emulation: 512 bytes
// more per attention call after an earlier test's GEMMs).
template <class Call>
size_t rise(Device dev, Call&& call) {
  Allocator& a = Allocator::get(dev);
  a.empty_cache();
  const size_t base = a.stats().allocated;
  a.reset_peak();
  call();
  return a.stats().peak_allocated - base;
}
// `op(dev)` makes its tensors on dev and returns rise(dev, the call).
template <class Op>
void expect_scratch_modeled(const std::string& what, Op&& op) {
  {
    Tensor x = Tensor::zeros({8, 8}, DType::f32, Device::cuda), y = x;
    ops::linear(x, x, y);  // the workspace, if no GEMM ran before
  }
  const size_t real = op(Device::cuda);
  const ops::ModeledDevice gpu(Device::cuda);
  {
    Tensor x = Tensor::empty({8, 8}, DType::f32, Device::meta), y = x;
    ops::linear(x, x, y);  // the workspace, kept for the scope
  }
  EXPECT_EQ(op(Device::meta), real) << what;
}

TEST_F(OpsCuda, ScratchIsWhatTheMetaRunBooks) {
  const int64_t B = 2, T = 200, Hq = 4, Hkv = 2;
  for (int64_t D : {16, 48, 64, 128})
    for (DType dt : {DType::f32, DType::bf16})
      for (bool backward : {false, true}) {
        // The values do not matter here (no result is read): uninitialized inputs.
        const auto op = [&](Device dev) {
          const auto t = [&](const Shape& s, DType d) { return Tensor::empty(s, d, dev); };
          Tensor qkv = t({B * T, (Hq + 2 * Hkv) * D}, dt);
          Tensor q = qkv.narrow(1, 0, Hq * D), k = qkv.narrow(1, Hq * D, Hkv * D),
                 v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
          Tensor out = t({B * T, Hq * D}, dt), lse = t({B, Hq, T}, DType::f32);
          Tensor dout = t({B * T, Hq * D}, DType::f32);
          Tensor dqkv = t({B * T, (Hq + 2 * Hkv) * D}, DType::f32);
          Tensor dq = dqkv.narrow(1, 0, Hq * D), dk = dqkv.narrow(1, Hq * D, Hkv * D),
                 dv = dqkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
          return rise(dev, [&] {
            if (!backward)
              ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse);
            else
              ops::attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv);
          });
        };
        expect_scratch_modeled(
            std::string(backward ? "attention_backward D " : "attention_forward D ") +
                std::to_string(D) + " " + std::string(dtype_name(dt)),
            op);
      }
  for (DType dt : {DType::f32, DType::bf16}) {
    const int64_t N = 300, Dm = 64, V = 5000;
    expect_scratch_modeled("linear_cross_entropy " + std::string(dtype_name(dt)), [&](Device dev) {
      ops::LinearCrossEntropy a;
      a.x = Tensor::zeros({N, Dm}, dt);
      a.w = Tensor::zeros({V, Dm}, dt);
      if (dev == Device::cuda) a.x = on_gpu(a.x), a.w = on_gpu(a.w);
      if (dev == Device::meta)
        a.x = Tensor::empty({N, Dm}, dt, dev), a.w = Tensor::empty({V, Dm}, dt, dev);
      a.dx = Tensor::empty({N, Dm}, DType::f32, dev);
      a.dw = Tensor::empty({V, Dm}, DType::f32, dev);
      a.targets = ops::index_tensor(test::random_tokens(N, V, 3), dev, "target", 0, V);
      a.loss = Tensor::empty({1}, DType::f64, dev);
      a.V = V, a.chunk_rows = 64, a.grad_rows = 128;
      return rise(dev, [&] { ops::linear_cross_entropy(a); });
    });
  }
}

// The row kernels' scratch (RMSNorm's dw partials, the embedding's status word and its backward's
// sort and runs, the gradient norm's partial sums) and the rotary table's device copy booked as
// the GPU allocates them: a training step's peak on the GPU is its meta run's to the byte (`loom
// bench step --check`; found on the CUDA emulation, 4 KiB apart for the debug Llama).
TEST_F(OpsCuda, RowOpsScratchIsWhatTheMetaRunBooks) {
  const int64_t rows = 300, dim = 72, vocab = 50;
  const auto tensor = [](Device dev, const Shape& s, DType dt = DType::f32) {
    return dev == Device::meta ? Tensor::empty(s, dt, dev) : Tensor::zeros(s, dt, dev);
  };
  for (DType xt : {DType::f32, DType::bf16})
    expect_scratch_modeled("rmsnorm_backward " + std::string(dtype_name(xt)), [&](Device dev) {
      Tensor dy = tensor(dev, {rows, dim}), x = tensor(dev, {rows, dim}, xt),
             w = tensor(dev, {dim}), rstd = tensor(dev, {rows}), dx = tensor(dev, {rows, dim}),
             dw = tensor(dev, {dim});
      return rise(dev, [&] { ops::rmsnorm_backward(dy, x, w, rstd, dx, dw); });
    });
  expect_scratch_modeled("embedding_forward", [&](Device dev) {
    const Tensor tokens =
        ops::index_tensor(test::random_tokens(rows, vocab, 3), dev, "token", 0, vocab);
    Tensor table = tensor(dev, {vocab, dim}), out = tensor(dev, {rows, dim});
    return rise(dev, [&] { ops::embedding_forward(tokens, table, out); });
  });
  expect_scratch_modeled("embedding_backward", [&](Device dev) {
    const Tensor tokens =
        ops::index_tensor(test::random_tokens(rows, vocab, 3), dev, "token", 0, vocab);
    Tensor dout = tensor(dev, {rows, dim}), dtable = tensor(dev, {vocab, dim});
    return rise(dev, [&] { ops::embedding_backward(tokens, dout, dtable); });
  });
  expect_scratch_modeled("rope_table", [&](Device dev) {
    return rise(dev,
                [&] { const ops::Rope r = ops::rope_table(16, 64, 10000.0, RopeScaling{}, dev); });
  });
  expect_scratch_modeled("sum_squares_each", [&](Device dev) {
    const std::vector<Tensor> xs{tensor(dev, {rows, dim}), tensor(dev, {70000})};
    return rise(dev, [&] { ops::sum_squares_each(xs); });
  });
  expect_scratch_modeled("bias_grad", [&](Device dev) {
    Tensor dy = tensor(dev, {rows, dim}), db = tensor(dev, {dim});
    return rise(dev, [&] { ops::bias_grad(dy, db); });
  });
  // GLA's ops: the gate with a bias, the gated norm with a weight, the short convolution (width
  // 4), the chunked core (2 samples of 150 tokens, 4 heads on 2 kv heads, K 16, V 24, chunk 64).
  expect_scratch_modeled("gla_gate_backward", [&](Device dev) {
    Tensor dgk = tensor(dev, {rows, dim}), z = tensor(dev, {rows, dim}), bias = tensor(dev, {dim}),
           dz = tensor(dev, {rows, dim}), dbias = tensor(dev, {dim});
    return rise(dev, [&] { ops::gla_gate_backward(dgk, z, bias, 16.0f, -5.0f, dz, dbias); });
  });
  expect_scratch_modeled("gated_rmsnorm_backward", [&](Device dev) {
    const int64_t heads = 3;
    Tensor dy = tensor(dev, {rows, dim}), x = tensor(dev, {rows, dim}),
           g = tensor(dev, {rows, dim}), w = tensor(dev, {dim / heads}),
           rstd = tensor(dev, {rows * heads}), dx = tensor(dev, {rows, dim}),
           dg = tensor(dev, {rows, dim}), dw = tensor(dev, {dim / heads});
    return rise(dev, [&] { ops::gated_rmsnorm_backward(dy, x, g, w, rstd, heads, dx, dg, dw); });
  });
  expect_scratch_modeled("short_conv_backward", [&](Device dev) {
    Tensor dy = tensor(dev, {rows, dim}), x = tensor(dev, {rows, dim}), w = tensor(dev, {dim, 4}),
           dx = tensor(dev, {rows, dim}), dw = tensor(dev, {dim, 4});
    return rise(dev, [&] { ops::short_conv_backward(dy, x, w, 2, dx, dw); });
  });
  // The mixture of experts' grouping, with and without capacities (6 experts, top 2 of each row,
  // spread evenly, as the meta run assumes), and the vocabulary-parallel loss's combine (3 ranks).
  const int64_t E = 6, topk = 2;
  std::vector<int32_t> choice(size_t(rows * topk));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < topk; ++j) choice[size_t(r * topk + j)] = int32_t((r + 3 * j) % E);
  for (const int64_t capacity : {0, 40})
    expect_scratch_modeled("moe_permute capacity " + std::to_string(capacity), [&](Device dev) {
      const Tensor experts = ops::index_tensor(choice, dev, "expert", 0, E).view({rows, topk});
      return rise(dev,
                  [&] { const ops::MoePermutation p = ops::moe_permute(experts, E, capacity); });
    });
  expect_scratch_modeled("vocab_shard_combine", [&](Device dev) {
    const Tensor targets =
        ops::index_tensor(test::random_tokens(rows, vocab, 4), dev, "target", 0, vocab);
    Tensor lse_all = tensor(dev, {3, rows}), target_logit = tensor(dev, {rows}),
           glse = tensor(dev, {3, rows}), loss = tensor(dev, {1}, DType::f64);
    return rise(dev, [&] { ops::vocab_shard_combine(lse_all, targets, target_logit, glse, loss); });
  });
  const ops::Gla gla{2, 4, 2, 64, 16};
  const int64_t T = 150, K = 16, V = 24, n = gla.B * T;
  for (bool backward : {false, true})
    expect_scratch_modeled(backward ? "gla_backward" : "gla_forward", [&](Device dev) {
      Tensor q = tensor(dev, {n, gla.H * K}), k = tensor(dev, {n, gla.Hkv * K}),
             v = tensor(dev, {n, gla.Hkv * V}), gk = tensor(dev, {n, gla.Hkv * K}), none;
      Tensor o = tensor(dev, {n, gla.H * V}), ht;
      if (!backward) return rise(dev, [&] { ops::gla_forward(gla, q, k, v, gk, none, o, ht); });
      Tensor dq = tensor(dev, {n, gla.H * K}), dk = tensor(dev, {n, gla.Hkv * K}),
             dv = tensor(dev, {n, gla.Hkv * V}), dgk = tensor(dev, {n, gla.Hkv * K}), dh0;
      return rise(
          dev, [&] { ops::gla_backward(gla, q, k, v, gk, none, o, none, dq, dk, dv, dgk, dh0); });
    });
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
  const Tensor t = ops::index_tensor(targets, Device::cpu, "target", INT32_MIN, V);
  const Tensor gt = ops::index_tensor(targets, Device::cuda, "target", INT32_MIN, V);
  ops::LinearCrossEntropy a{x, w, dx, ops::WeightGrad(dw), t, V, 1.0f / 39, 16, 0, {}};
  ops::LinearCrossEntropy g{gx, gw, gdx, ops::WeightGrad(gdw), gt, V, 1.0f / 39, 16, 0, {}};
  const double loss = ops::linear_cross_entropy(a), gloss = ops::linear_cross_entropy(g);
  EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
  // The loss left on the device (a step's slot): the same double, read when the caller wants it.
  g.loss = Tensor::empty({1}, DType::f64, Device::cuda);
  g.dx = Tensor::empty({N, D}, DType::f32, Device::cuda);
  g.dw = ops::WeightGrad(on_gpu(Tensor::zeros({V, D}, DType::f32)));
  EXPECT_EQ(ops::linear_cross_entropy(g), 0.0);
  EXPECT_EQ(g.loss.on_host().data<double>()[0], gloss);
  expect_close(dx, gdx, 1e-5, "loss dx");
  expect_close(dw, gdw, 1e-5, "loss dw");
}

// ---- mixture of experts: a layer's ops in the model's order (model/moe_ffn.cpp) ----------------

struct MoeInputs {
  Tensor logits, bias, x, y0, dy, dprob;
  std::vector<Tensor> w;  // each expert's [d, d] matrix
  int64_t k = 2, capacity = 0;
  DType dt = DType::f32;
};
// Every tensor the layer's forward and backward write, on one device.
struct MoeRun {
  Tensor probs, experts, weights, prob_sum, xs, ys, y, dys, dweights, dxs, dx, dlogits;
  ops::MoePermutation perm;
  std::vector<Tensor> dw;
};

Tensor on(const Tensor& h, Device dev) {
  Tensor d = Tensor::empty(h.shape(), h.dtype(), dev);
  d.copy_from(h);
  return d;
}

// The router on given logits (not a GEMM's: the choice must not hang on the GEMMs' last bits), the
// grouping, the gather, one GEMM per expert, the weighted sum, and back.
MoeRun run_moe(const MoeInputs& in, Device dev) {
  const int64_t M = in.logits.size(0), E = in.logits.size(1), d = in.x.size(1), k = in.k;
  MoeRun r;
  const Tensor logits = on(in.logits, dev), bias = on(in.bias, dev), x = on(in.x, dev);
  std::vector<Tensor> w;
  for (const Tensor& t : in.w) w.push_back(on(t, dev));
  r.probs = Tensor::empty({M, E}, DType::f32, dev);
  r.experts = Tensor::empty({M, k}, DType::i32, dev);
  r.weights = Tensor::empty({M, k}, DType::f32, dev);
  r.prob_sum = Tensor::zeros({E}, DType::f32, dev);
  ops::moe_route(logits, bias, true, r.probs, r.experts, r.weights, r.prob_sum);
  r.perm = ops::moe_permute(r.experts, E, in.capacity);
  const int64_t N = r.perm.rows();
  r.xs = Tensor::empty({N, d}, in.dt, dev);
  ops::moe_dispatch(x, r.perm.order, k, r.xs);
  r.ys = Tensor::empty({N, d}, in.dt, dev);
  ops::grouped_linear(r.xs, w, r.perm.counts, r.ys);
  r.y = on(in.y0, dev);
  ops::moe_combine(r.ys, r.weights, r.perm.pos, r.y);

  const Tensor dy = on(in.dy, dev);
  r.dys = Tensor::empty({N, d}, in.dt, dev);
  r.dweights = Tensor::empty({M, k}, DType::f32, dev);
  ops::moe_combine_backward(dy, r.ys, r.weights, r.perm.pos, r.dys, r.dweights);
  std::vector<ops::WeightGrad> dw;
  for (int64_t e = 0; e < E; ++e) {
    r.dw.push_back(Tensor::zeros({d, d}, DType::f32, dev));
    dw.emplace_back(r.dw.back());
  }
  r.dxs = Tensor::empty({N, d}, DType::f32, dev);
  ops::grouped_linear_backward(r.dys, r.xs, w, r.perm.counts, dw, r.dxs);
  r.dx = Tensor::empty({M, d}, DType::f32, dev);
  ops::moe_dispatch_backward(r.dxs, r.perm.pos, k, r.dx, false);
  r.dlogits = Tensor::empty({M, E}, DType::f32, dev);
  ops::moe_route_backward(r.probs, r.experts, r.weights, r.dweights, true, on(in.dprob, dev),
                          r.dlogits);
  return r;
}

std::vector<int32_t> ints(const Tensor& t) {
  const Tensor h = t.on_host();
  return std::vector<int32_t>(h.data<int32_t>(), h.data<int32_t>() + h.numel());
}

TEST_F(OpsCuda, MixtureOfExpertsLayerMatchesCpu) {
  const int64_t d = 64, E = 8;
  for (const int64_t M : {int64_t{45}, int64_t{0}})
    for (const int64_t capacity : {int64_t{0}, int64_t{9}})
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE("M " + std::to_string(M) + ", capacity " + std::to_string(capacity) + ", " +
                     std::string(dtype_name(dt)));
        MoeInputs in;
        in.capacity = capacity;
        in.dt = dt;
        in.logits = random({M, E}, 1);
        for (int64_t t = 0; t < M; ++t) in.logits.data<float>()[t * E + 3] = -30;  // no rows
        in.bias = random({E}, 2);
        for (int64_t e = 0; e < E; ++e) in.bias.data<float>()[e] *= 0.01f;
        in.x = random({M, d}, 3, dt);
        in.y0 = random({M, d}, 4);
        in.dy = random({M, d}, 5);
        in.dprob = random({E}, 6);
        for (int64_t e = 0; e < E; ++e) in.w.push_back(random({d, d}, 10 + uint64_t(e), dt));
        const MoeRun c = run_moe(in, Device::cpu), g = run_moe(in, Device::cuda);

        expect_close(c.probs, g.probs, 1e-6, "moe_route probs");
        ASSERT_EQ(ints(g.experts), ints(c.experts)) << "moe_route's choice";
        expect_close(c.weights, g.weights, 1e-6, "moe_route weights");
        expect_close(c.prob_sum, g.prob_sum, 1e-6, "moe_route prob_sum");
        EXPECT_EQ(g.perm.counts, c.perm.counts);
        EXPECT_EQ(g.perm.dropped, c.perm.dropped);
        if (M > 0) {
          EXPECT_EQ(c.perm.counts[3], 0) << "expert 3 has rows";
        }
        EXPECT_EQ(ints(g.perm.pos), ints(c.perm.pos));
        EXPECT_EQ(ints(g.perm.order), ints(c.perm.order));
        expect_close(c.xs, g.xs, 0, "moe_dispatch");
        const bool f32 = dt == DType::f32;
        expect_close(c.ys, g.ys, f32 ? 1e-5 : 4e-3, "grouped_linear");
        expect_close(c.y, g.y, f32 ? 1e-5 : 4e-3, "moe_combine");
        expect_close(c.dys, g.dys, f32 ? 1e-5 : 4e-3, "moe_combine_backward dys");
        expect_close(c.dweights, g.dweights, f32 ? 1e-5 : 1e-2, "moe_combine_backward dweights");
        expect_close(c.dxs, g.dxs, f32 ? 1e-5 : 1e-2, "grouped_linear_backward dx");
        for (int64_t e = 0; e < E; ++e)
          expect_close(c.dw[size_t(e)], g.dw[size_t(e)], f32 ? 1e-5 : 1e-2,
                       ("grouped_linear_backward dw of expert " + std::to_string(e)).c_str());
        const std::vector<float> dw3 = values(g.dw[3]);
        EXPECT_TRUE(std::all_of(dw3.begin(), dw3.end(), [](float v) { return v == 0.0f; }))
            << "the gradient of an expert with no rows changed";
        expect_close(c.dx, g.dx, f32 ? 1e-5 : 1e-2, "moe_dispatch_backward");
        expect_close(c.dlogits, g.dlogits, f32 ? 1e-5 : 1e-2, "moe_route_backward");
      }
}

TEST_F(OpsCuda, Qwen2BiasesAndSharedExpertGate) {
  const int64_t M = 37, q = 64, kv = 32, d = 48;
  // The q/k/v biases on column slices of a fused GEMM's output, and their gradients.
  Tensor qkv = random({M, q + 2 * kv}, 1), gqkv = on_gpu(qkv);
  Tensor b = random({kv}, 2), gb = on_gpu(b);
  Tensor k = qkv.narrow(1, q, kv), gk = gqkv.narrow(1, q, kv);
  ops::add_bias(k, b);
  ops::add_bias(gk, gb);
  expect_close(qkv, gqkv, 0, "add_bias on a column slice (and the columns it must leave)");
  Tensor db = random({kv}, 3), gdb = on_gpu(db);
  ops::bias_grad(qkv.narrow(1, q + kv, kv), db);
  ops::bias_grad(gqkv.narrow(1, q + kv, kv), gdb);
  expect_close(db, gdb, 1e-6, "bias_grad on a column slice");
  // The shared expert's sigmoid gate, ys and dys in either dtype.
  Tensor z = random({M, 1}, 4);
  for (int i = 0; i < 4; ++i) z.data<float>()[i * 9] = i % 2 ? -60.0f : 60.0f;  // the tails
  const Tensor gz = on_gpu(z);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    Tensor ys = random({M, d}, 5, dt), gys = on_gpu(ys);
    Tensor y = random({M, d}, 6), gy = on_gpu(y);
    ops::sigmoid_gate_forward(z, ys, y);
    ops::sigmoid_gate_forward(gz, gys, gy);
    expect_close(y, gy, 1e-6, "sigmoid_gate_forward");
    Tensor dy = random({M, d}, 7), gdy = on_gpu(dy);
    auto [dys, gdys] = outputs({M, d}, dt);
    auto [dz, gdz] = outputs({M, 1});
    ops::sigmoid_gate_backward(dy, z, ys, dys, dz);
    ops::sigmoid_gate_backward(gdy, gz, gys, gdys, gdz);
    expect_close(dys, gdys, dt == DType::f32 ? 1e-6 : 4e-3, "sigmoid_gate_backward dys");
    expect_close(dz, gdz, 1e-6, "sigmoid_gate_backward dz");
  }
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
  // Every op has a CUDA kernel now: the Backend's own method, on cuda, is what an op without one
  // would run.
  ops::Backend bare(Device::cuda);
  try {
    bare.attention_decode(x, w, w, 64, 1, 1, y);
    FAIL() << "the Backend's default ran attention_decode";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention_decode: no kernel on device cuda"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace loom
