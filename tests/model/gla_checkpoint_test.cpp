// GLA activation checkpointing: full and op give the bits of no checkpointing (the same kernels
// recompute the same tensors) and save less.
#include <gtest/gtest.h>

#include <vector>

#include "model/gla.hpp"
#include "tests/model/tiny_gla.hpp"
#include "tests/test_util.hpp"

using namespace loom;

TEST(GlaCheckpoint, FullAndOpGiveTheSameBitsAndSaveLess) {
  for (bool conv : {false, true}) {
    SCOPED_TRACE(conv ? "short conv" : "no conv");
    const GlaConfig c = test::tiny_gla_config(101, conv, false, 3);
    const int64_t B = 2, T = 40;
    const auto tok = test::random_tokens(B * T + 1, c.vocab_size, 6);
    struct Run {
      double loss;
      std::vector<std::vector<float>> grads;
      size_t saved;
    };
    auto run = [&](ActivationCheckpoint ac) {
      GlaModel m(c, DType::f32);
      m.init_weights(1);
      m.set_activation_checkpoint(ac);
      m.zero_grad();
      Run r;
      r.loss = m.forward_backward(tok.data(), tok.data() + 1, B, T, 0.01f);
      for (ParamUnit* u : m.units()) {
        const float* g = u->grad_flat().data<float>();
        r.grads.emplace_back(g, g + u->numel());
      }
      r.saved = m.last_saved_activation_bytes();
      return r;
    };
    using Mode = ActivationCheckpoint::Mode;
    const Run none = run({Mode::none, 1});
    const Run full = run({Mode::full, 1});
    const Run op = run({Mode::op, 1});
    const Run every2 = run({Mode::full, 2});  // blocks 0 and 2 full, block 1 saves everything
    for (const Run* r : {&full, &op, &every2}) {
      EXPECT_EQ(r->loss, none.loss);
      ASSERT_EQ(r->grads.size(), none.grads.size());
      for (size_t i = 0; i < none.grads.size(); ++i) EXPECT_EQ(r->grads[i], none.grads[i]) << i;
    }
    EXPECT_LT(full.saved, every2.saved);
    EXPECT_LT(every2.saved, none.saved);
    EXPECT_LT(full.saved, op.saved);
    EXPECT_LT(op.saved, none.saved);
  }
}
