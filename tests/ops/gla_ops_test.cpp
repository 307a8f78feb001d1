// The GLA ops: on cpu the bits of the kernels they dispatch to (strides taken from the views),
// on meta nothing computed and nothing dereferenced.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/gated_rmsnorm.hpp"
#include "kernels/cpu/gla.hpp"
#include "kernels/cpu/gla_gate.hpp"
#include "kernels/cpu/short_conv.hpp"
#include "ops/ops.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

Tensor random(const Shape& s, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(s, DType::f32);
  const auto v = test::randn(size_t(t.numel()), seed, scale);
  std::memcpy(t.raw(), v.data(), t.nbytes());
  return t;
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

constexpr float kNoClamp = -std::numeric_limits<float>::infinity();

}  // namespace

TEST(GlaOps, CpuOpsEqualTheKernels) {
  const int64_t B = 2, T = 19, H = 4, Hkv = 2, K = 8, V = 12, M = B * T;
  // q | k | v | gate logits in one buffer, as the fused projection writes them.
  const int64_t S = H * K + Hkv * K + Hkv * V + Hkv * K;
  Tensor fused = random({M, S}, 1);
  Tensor q = fused.narrow(1, 0, H * K), k = fused.narrow(1, H * K, Hkv * K),
         v = fused.narrow(1, H * K + Hkv * K, Hkv * V);
  Tensor z = Tensor::empty({M, Hkv * K}, DType::f32);
  ops::copy_rows(fused.narrow(1, S - Hkv * K, Hkv * K), z);
  Tensor gk = Tensor::empty({M, Hkv * K}, DType::f32);
  Tensor bias = random({Hkv * K}, 7);
  ops::gla_gate_forward(z, bias, 16.0f, kNoClamp, gk);
  std::vector<float> want_gk(size_t(M * Hkv * K));
  cpu::gla_gate_forward(z.data<float>(), bias.data<float>(), M, Hkv * K, 16.0f, kNoClamp,
                        want_gk.data());
  EXPECT_EQ(values(gk), want_gk);

  Tensor h0 = random({B, H, K, V}, 2), o = Tensor::empty({M, H * V}, DType::f32),
         ht = Tensor::empty({B, H, K, V}, DType::f32);
  const ops::Gla s{B, H, Hkv, 16, 4};
  ops::gla_forward(s, q, k, v, gk, h0, o, ht);
  cpu::GlaCore a;
  a.B = B, a.T = T, a.H = H, a.Hkv = Hkv, a.K = K, a.V = V, a.scale = 1.0f / std::sqrt(float(K));
  a.chunk = 16, a.sub_chunk = 4;
  const float* fp = fused.data<float>();
  a.q = {fp, S}, a.k = {fp + H * K, S}, a.v = {fp + H * K + Hkv * K, S}, a.gk = {want_gk.data(), 0};
  a.h0 = h0.data<float>();
  std::vector<float> want_o(size_t(M * H * V)), want_ht(size_t(B * H * K * V));
  cpu::gla_forward(a, {want_o.data(), 0}, want_ht.data());
  EXPECT_EQ(values(o), want_o);
  EXPECT_EQ(values(ht), want_ht);

  Tensor dout = random({M, H * V}, 3), dfused = Tensor::zeros({M, S}, DType::f32);
  Tensor dq = dfused.narrow(1, 0, H * K), dk = dfused.narrow(1, H * K, Hkv * K),
         dv = dfused.narrow(1, H * K + Hkv * K, Hkv * V);
  Tensor dgk = Tensor::empty({M, Hkv * K}, DType::f32),
         dh0 = Tensor::empty({B, H, K, V}, DType::f32);
  ops::gla_backward(s, q, k, v, gk, h0, dout, Tensor(), dq, dk, dv, dgk, dh0);
  std::vector<float> wd(size_t(M * S), 0.0f), wdgk(size_t(M * Hkv * K)), wdh0(want_ht.size());
  cpu::gla_backward(a, {dout.data<float>(), 0}, nullptr,
                    {{wd.data(), S},
                     {wd.data() + H * K, S},
                     {wd.data() + H * K + Hkv * K, S},
                     {wdgk.data(), 0},
                     wdh0.data()});
  EXPECT_EQ(values(dfused), wd);
  EXPECT_EQ(values(dgk), wdgk);
  EXPECT_EQ(values(dh0), wdh0);

  Tensor dz = Tensor::empty({M, Hkv * K}, DType::f32), db = Tensor::zeros({Hkv * K}, DType::f32);
  ops::gla_gate_backward(dgk, z, bias, 16.0f, -0.01f, dz, db);
  std::vector<float> wdz(wdgk.size()), wdb(size_t(Hkv * K), 0.0f);
  cpu::gla_gate_backward(wdgk.data(), z.data<float>(), bias.data<float>(), M, Hkv * K, 16.0f,
                         -0.01f, wdz.data(), wdb.data());
  EXPECT_EQ(values(dz), wdz);
  EXPECT_EQ(values(db), wdb);

  // The output norm with the gate read from a view, its weight accumulated.
  Tensor gfused = random({M, H * V + 5}, 4), g = gfused.narrow(1, 0, H * V);
  Tensor w = random({V}, 5), y = Tensor::empty({M, H * V}, DType::f32),
         rstd = Tensor::empty({M * H}, DType::f32);
  ops::gated_rmsnorm_forward(o, g, w, H, 1e-6f, y, rstd);
  const cpu::GatedRmsNorm ns{M, H, V, 1e-6f};
  std::vector<float> wy(size_t(M * H * V)), wr(size_t(M * H));
  cpu::gated_rmsnorm_forward(ns, want_o.data(), gfused.data<float>(), H * V + 5, w.data<float>(),
                             wy.data(), wr.data());
  EXPECT_EQ(values(y), wy);
  EXPECT_EQ(values(rstd), wr);
  Tensor dgf = Tensor::zeros({M, H * V + 5}, DType::f32), dg = dgf.narrow(1, 0, H * V);
  Tensor dx = Tensor::empty({M, H * V}, DType::f32), dw = Tensor::zeros({V}, DType::f32);
  ops::gated_rmsnorm_backward(dout, o, g, w, rstd, H, dx, dg, dw);
  std::vector<float> wdx(size_t(M * H * V)), wdg(size_t(M * (H * V + 5)), 0.0f),
      wdw(size_t(V), 0.0f);
  cpu::gated_rmsnorm_backward(ns, dout.data<float>(), want_o.data(), gfused.data<float>(),
                              H * V + 5, w.data<float>(), wr.data(), wdx.data(), wdg.data(),
                              H * V + 5, wdw.data());
  EXPECT_EQ(values(dx), wdx);
  EXPECT_EQ(values(dgf), wdg);
  EXPECT_EQ(values(dw), wdw);

  // The short convolution on the q view, fla's [C, 1, W] weight.
  Tensor cw = random({H * K, 1, 4}, 6), cy = Tensor::empty({M, H * K}, DType::f32);
  ops::short_conv_forward(q, cw, B, cy);
  const cpu::ShortConv cs{B, T, H * K, 4};
  std::vector<float> wcy(size_t(M * H * K));
  cpu::short_conv_forward(cs, fp, S, cw.data<float>(), wcy.data(), 0);
  EXPECT_EQ(values(cy), wcy);
  Tensor cdx = Tensor::empty({M, H * K}, DType::f32),
         cdw = Tensor::zeros({H * K, 1, 4}, DType::f32);
  ops::short_conv_backward(cy, q, cw, B, cdx, cdw);
  std::vector<float> wcdx(size_t(M * H * K)), wcdw(size_t(H * K * 4), 0.0f);
  cpu::short_conv_backward(cs, wcy.data(), 0, fp, S, cw.data<float>(), wcdx.data(), 0, wcdw.data());
  EXPECT_EQ(values(cdx), wcdx);
  EXPECT_EQ(values(cdw), wcdw);
}

TEST(GlaOps, MetaComputesNothing) {
  const int64_t B = 2, T = 8, H = 2, K = 4, V = 4, M = B * T;
  auto meta = [](const Shape& s) { return Tensor::empty(s, DType::f32, Device::meta); };
  Tensor q = meta({M, H * K}), k = meta({M, H * K}), v = meta({M, H * V}), gk = meta({M, H * K});
  Tensor o = meta({M, H * V}), ht = meta({B, H, K, V});
  // The meta pointers are never dereferenced: any kernel call would crash.
  const ops::Gla s{B, H, H};
  ops::gla_forward(s, q, k, v, gk, Tensor(), o, ht);
  Tensor dq = meta({M, H * K}), dk = meta({M, H * K}), dv = meta({M, H * V}),
         dgk = meta({M, H * K}), dh0 = meta({B, H, K, V});
  ops::gla_backward(s, q, k, v, gk, Tensor(), o, ht, dq, dk, dv, dgk, dh0);
  Tensor decay = meta({B, H, K});
  ops::gla_decay_total(s, gk, decay);
  ops::gla_state_fold(s, decay, ht, ht);
  Tensor b = meta({H * K});
  ops::gla_gate_forward(gk, b, 16.0f, kNoClamp, gk);
  ops::gla_gate_backward(dgk, gk, b, 16.0f, kNoClamp, dgk, b);
  Tensor rstd = meta({M * H}), w = meta({V});
  ops::gated_rmsnorm_forward(o, v, w, H, 1e-6f, o, rstd);
  ops::gated_rmsnorm_backward(o, o, v, w, rstd, H, dv, dv, w);
  Tensor cw = meta({H * K, 4});
  ops::short_conv_forward(q, cw, B, dq);
  ops::short_conv_backward(q, q, cw, B, dq, cw);
}

TEST(GlaOps, RejectsShapesThatDoNotSplit) {
  Tensor q = Tensor::empty({9, 8}, DType::f32, Device::meta);
  Tensor none;
  test::expect_error(
      [&] {
        ops::gla_forward({2, 2, 2}, q, q, q, q, none, q, none);
      },
      {"gla_forward", "B 2"});
}
