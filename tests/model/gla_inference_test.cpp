// GLA generation with a recurrent state: the logits do not depend on how the sequence is fed
// (all at once, token by token, in uneven pieces), and the all-at-once logits give the loss of
// the training forward (which tests/model/gla_parity_test.cpp checks against PyTorch).
#include "model/gla_inference.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/philox.hpp"
#include "model/gla.hpp"
#include "tests/model/tiny_gla.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

GlaConfig config(bool conv, bool tied) {
  return test::tiny_gla_config(97, conv, tied);
}

void perturb(GlaModel& m) {
  // The gate bias away from 0 (and the norms from 1), as in a trained model.
  for (ParamUnit* u : m.units())
    for (auto& p : u->params())
      if (p.spec.init == Init::ones || p.spec.std == 0) {
        std::vector<float> r(size_t(p.value.numel()));
        philox_normal(philox_key(5, p.spec.name), 0, int64_t(r.size()),
                      p.spec.init == Init::ones ? 1.0f : 0.0f, 0.5f, r.data());
        std::copy(r.begin(), r.end(), p.value.data<float>());
      }
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

}  // namespace

TEST(GlaInference, FeedingOrderDoesNotChangeLogitsAndMatchesTraining) {
  for (bool conv : {false, true}) {
    SCOPED_TRACE(conv ? "short conv" : "no conv");
    GlaModel model(config(conv, !conv), DType::f32);
    model.init_weights(3);
    perturb(model);
    const int64_t T = 70, V = 97;  // more than one chunk of the core
    const auto tok = test::random_tokens(T + 1, V, 4);
    GlaInference inf(model);
    const std::vector<float> all = values(inf.forward(tok.data(), T, true));
    ASSERT_EQ(int64_t(all.size()), T * V);
    EXPECT_EQ(inf.length(), T);

    // Token by token, and in uneven pieces (a prefill of 5, then 1, 17, 47), after a reset.
    for (const std::vector<int64_t>& pieces :
         {std::vector<int64_t>(size_t(T), 1), std::vector<int64_t>{5, 1, 17, 47}}) {
      inf.reset();
      std::vector<float> got;
      int64_t t = 0;
      for (int64_t n : pieces) {
        const auto l = values(inf.forward(tok.data() + t, n, true));
        got.insert(got.end(), l.begin(), l.end());
        t += n;
      }
      ASSERT_EQ(got.size(), all.size());
      EXPECT_LT(test::rel_l2(got, all), 1e-5) << pieces.size() << " pieces";
    }
    // The last token's logits alone.
    inf.reset();
    inf.forward(tok.data(), T - 1);
    const auto last = values(inf.forward(tok.data() + T - 1, 1));
    EXPECT_LT(test::rel_l2(last, std::vector<float>(all.end() - V, all.end())), 1e-5);

    // Cross-entropy of the all-at-once logits = the training forward's loss.
    double ce = 0;
    for (int64_t t = 0; t < T; ++t) {
      double mx = -1e30, s = 0;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(all[t * V + v]));
      for (int64_t v = 0; v < V; ++v) s += std::exp(double(all[t * V + v]) - mx);
      ce += mx + std::log(s) - double(all[t * V + tok[t + 1]]);
    }
    model.zero_grad();
    const double loss = model.forward_backward(tok.data(), tok.data() + 1, 1, T, 1.0f);
    EXPECT_LT(std::abs(ce - loss) / loss, 1e-5) << ce << " vs " << loss;
  }
}
