#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kernels/cpu/cast.hpp"
#include "model/llama.hpp"
#include "tests/test_util.hpp"
#include "train/optimizer.hpp"

using namespace loom;

namespace {

LlamaConfig tiny() {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 67;
  return c;
}

}  // namespace

// Every parameter follows PyTorch's AdamW in fp64, with weight decay on matrices only (norm
// weights have none), across steps, also through the bf16 mirror.
TEST(AdamW, MatchesReferenceWithDecayOnlyOnMatrices) {
  for (DType dt : {DType::f32, DType::bf16}) {
    LlamaModel model(tiny(), dt);
    model.init_weights(3);
    AdamWConfig c{1e-2f, 0.9f, 0.95f, 1e-8f, 0.3f};
    AdamW opt(model.units(), c);
    struct Ref {
      std::vector<double> p, m, v;
    };
    std::vector<std::vector<Ref>> ref;
    for (ParamUnit* u : model.units()) {
      ref.emplace_back();
      for (auto& p : u->params()) {
        const float* d = p.value.data<float>();
        ref.back().push_back({std::vector<double>(d, d + p.value.numel()),
                              std::vector<double>(p.value.numel()),
                              std::vector<double>(p.value.numel())});
      }
    }
    for (int step = 1; step <= 3; ++step) {
      size_t ui = 0;
      for (ParamUnit* u : model.units()) {
        auto g = test::randn(size_t(u->numel()), 100 * step + ui);
        std::copy(g.begin(), g.end(), u->grad_flat().data<float>());
        for (size_t pi = 0; pi < u->params().size(); ++pi) {
          auto& p = u->params()[pi];
          auto& r = ref[ui][pi];
          const double wd = p.spec.decay ? c.weight_decay : 0.0;
          for (size_t k = 0; k < r.p.size(); ++k) {
            const double gk = g[p.offset + k];
            r.p[k] -= c.lr * wd * r.p[k];
            r.m[k] = c.beta1 * r.m[k] + (1 - c.beta1) * gk;
            r.v[k] = c.beta2 * r.v[k] + (1 - c.beta2) * gk * gk;
            const double mh = r.m[k] / (1 - std::pow(double(c.beta1), step));
            const double vh = r.v[k] / (1 - std::pow(double(c.beta2), step));
            r.p[k] -= c.lr * mh / (std::sqrt(vh) + c.eps);
          }
        }
        ++ui;
      }
      opt.step(c.lr);
    }
    size_t ui = 0;
    for (ParamUnit* u : model.units()) {
      for (size_t pi = 0; pi < u->params().size(); ++pi) {
        auto& p = u->params()[pi];
        const float* d = p.value.data<float>();
        std::vector<float> got(d, d + p.value.numel());
        EXPECT_LT(test::rel_l2(got, ref[ui][pi].p), 1e-6) << p.spec.name;
        if (dt == DType::bf16) {
          const bf16* h = p.value_bf16.data<bf16>();
          for (size_t k = 0; k < got.size(); ++k)
            ASSERT_EQ(h[k].bits, float_to_bf16(got[k]).bits) << p.spec.name;
        }
      }
      ++ui;
    }
  }
}

TEST(ClipGradNorm, ScalesToMaxNormLikePyTorch) {
  LlamaModel model(tiny(), DType::f32);
  double ss = 0;
  size_t ui = 0;
  for (ParamUnit* u : model.units()) {
    auto g = test::randn(size_t(u->numel()), 7 + ui++);
    std::copy(g.begin(), g.end(), u->grad_flat().data<float>());
    for (float x : g) ss += double(x) * x;
  }
  const double norm = clip_grad_norm(model.units(), 1.0);
  EXPECT_NEAR(norm, std::sqrt(ss), 1e-9 * std::sqrt(ss));
  double after = 0;
  for (ParamUnit* u : model.units())
    for (int64_t k = 0; k < u->numel(); ++k) after += std::pow(u->grad_flat().data<float>()[k], 2);
  EXPECT_NEAR(std::sqrt(after), 1.0 / (1.0 + 1e-6 / std::sqrt(ss)), 1e-5);
  EXPECT_NEAR(clip_grad_norm(model.units(), 10.0), std::sqrt(after), 1e-6);  // below: unchanged
}

// The step clips inside AdamW (clip_grad_scale as its grad_scale): the same weights, moments and
// bf16 mirrors to the bit as clip_grad_norm's in-place scaling followed by a plain step.
TEST(ClipGradNorm, ScaleInTheOptimizerEqualsClippingInPlace) {
  LlamaModel a(tiny(), DType::bf16), b(tiny(), DType::bf16);
  size_t ui = 0;
  for (auto* m : {&a, &b}) {
    m->init_weights(5);
    ui = 0;
    for (ParamUnit* u : m->units()) {
      auto g = test::randn(size_t(u->numel()), 70 + ui++);
      std::copy(g.begin(), g.end(), u->grad_flat().data<float>());
    }
  }
  AdamW oa(a.units(), {}), ob(b.units(), {});
  for (const double max_norm : {0.5, 1e9, 0.0}) {
    const double na = clip_grad_norm(a.units(), max_norm);
    oa.step(1e-3f);
    const double nb = grad_norm(b.units());
    EXPECT_EQ(na, nb);
    const float s = clip_grad_scale(nb, max_norm);
    EXPECT_EQ(s == 1.0f, max_norm == 0.0 || nb <= max_norm) << max_norm;
    ob.step(1e-3f, s);
    for (size_t i = 0; i < a.units().size(); ++i) {
      ParamUnit &ua = *a.units()[i], &ub = *b.units()[i];
      const size_t n = size_t(ua.numel());
      EXPECT_EQ(std::memcmp(ua.flat().data<float>(), ub.flat().data<float>(), n * 4), 0) << i;
      EXPECT_EQ(std::memcmp(oa.exp_avg()[i].data<float>(), ob.exp_avg()[i].data<float>(), n * 4),
                0);
      EXPECT_EQ(std::memcmp(ua.flat_bf16().data<bf16>(), ub.flat_bf16().data<bf16>(), n * 2), 0);
    }
    // Both keep their (a: clipped) gradients for the next round.
    if (max_norm == 0.5)
      for (ParamUnit* u : b.units())
        cpu::scale_inplace(u->grad_flat().data<float>(), u->numel(), s);
  }
}
