// GLA under tensor parallelism (run by mpirun on 2 ranks, every rank runs every test), with and
// without sequence parallelism and checkpointing: the tp model's loss equals the single-process
// model's, and each rank's parameter gradients equal the matching slices of the single-process
// gradients, the replicated gk_proj.0 and head norm (whose gradients are partial sums over tp)
// included. One case loads its weights from an fla-format checkpoint (each rank its slices).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "distributed/mpi_process_group.hpp"
#include "model/gla.hpp"
#include "model/safetensors.hpp"
#include "tests/model/tiny_gla.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

// This rank's part of a global gradient, as ParamSpec::for_global_runs lays it out.
std::vector<float> local_slice(const ParamSpec& spec, const float* global) {
  std::vector<float> out(size_t(shape_numel(spec.shape)));
  spec.for_global_runs(0, int64_t(out.size()), [&](int64_t g, int64_t n, int64_t local) {
    std::copy_n(global + g, n, out.data() + local);
  });
  return out;
}

}  // namespace

TEST(GlaTensorParallel, MatchesSingleProcess) {
  auto group = dist::make_mpi_world_group("tp");
  ASSERT_EQ(group->size(), 2);
  for (auto [conv, sp, ac] : {std::tuple{false, false, ActivationCheckpoint::Mode::none},
                              std::tuple{true, false, ActivationCheckpoint::Mode::none},
                              std::tuple{false, true, ActivationCheckpoint::Mode::none},
                              std::tuple{true, true, ActivationCheckpoint::Mode::op},
                              std::tuple{false, true, ActivationCheckpoint::Mode::full}}) {
    SCOPED_TRACE(str_cat(conv ? "short conv" : "no conv", sp ? ", SP" : "", ", AC ", int(ac)));
    GlaConfig c;
    c.hidden_size = 64;
    c.num_hidden_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;  // GQA: one kv head and two query heads per rank
    c.intermediate_size = 96;
    c.vocab_size = 101;
    c.use_short_conv = conv;
    const int64_t B = 2, T = 37;
    const auto tok = test::random_tokens(B * T + 1, c.vocab_size, 8);

    GlaModel one(c, DType::f32);
    one.init_weights(5);
    one.zero_grad();
    const double loss1 = one.forward_backward(tok.data(), tok.data() + 1, B, T, 0.01f);

    TpOptions tp;
    tp.group = group.get();
    tp.sequence_parallel = sp;
    GlaModel split(c, DType::f32, Device::cpu, {}, tp);
    split.set_activation_checkpoint({ac, 1});
    if (conv && sp) {
      // Each rank reads its slices of the single-process model's fla-format checkpoint.
      const std::string dir = str_cat(testing::TempDir(), "loom_gla_tp_io_", group->rank());
      one.save_hf(dir);
      split.load_hf(SafetensorsDir(dir));
      std::filesystem::remove_all(dir);
    } else {
      split.init_weights(5);  // Philox by global index: each rank's slices of the same weights
    }
    split.zero_grad();
    const double loss2 = split.forward_backward(tok.data(), tok.data() + 1, B, T, 0.01f);
    EXPECT_LT(std::abs(loss2 - loss1) / std::abs(loss1), 1e-6);

    auto u1 = one.units(), u2 = split.units();
    ASSERT_EQ(u1.size(), u2.size());
    int compared = 0;
    for (size_t i = 0; i < u1.size(); ++i) {
      ASSERT_EQ(u1[i]->params().size(), u2[i]->params().size());
      for (size_t j = 0; j < u1[i]->params().size(); ++j) {
        const Param& p1 = u1[i]->params()[j];
        const Param& p2 = u2[i]->params()[j];
        ASSERT_EQ(p1.spec.name, p2.spec.name);
        const auto want_w = local_slice(p2.spec, p1.value.data<float>());
        const float* w = p2.value.data<float>();
        ASSERT_EQ(std::vector<float>(w, w + want_w.size()), want_w) << p2.spec.name;
        const auto want = local_slice(p2.spec, p1.grad.data<float>());
        const float* g = p2.grad.data<float>();
        EXPECT_LT(test::rel_l2(std::vector<float>(g, g + want.size()), want), 1e-5) << p2.spec.name;
        ++compared;
      }
    }
    EXPECT_EQ(compared, int(c.params().size()));
  }
}

TEST(GlaTensorParallel, RefusesUnevenHeads) {
  auto group = dist::make_mpi_world_group("tp");
  GlaConfig c;
  c.hidden_size = 64;
  c.num_hidden_layers = 1;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 96;
  c.vocab_size = 101;
  TpOptions tp;
  tp.group = group.get();
  c.num_kv_heads = 1;
  test::expect_error([&] { GlaModel m(c, DType::f32, Device::cpu, {}, tp); },
                     {"num_kv_heads", "1", "parallelism.tp = 2"});
}

// Context parallelism by state passing over 2 ranks (zigzag: rank r holds segments r and 3 - r
// of every sample, so rank 1's two segments are adjacent): the losses and gradients of the two
// ranks sum to the single-process run's, also with checkpointing `full` (its recomputation runs
// the all-gathers again).
TEST(GlaContextParallel, MatchesSingleProcess) {
  auto group = dist::make_mpi_world_group("cp");
  const int cpn = group->size(), rank = group->rank();
  ASSERT_EQ(cpn, 2);
  for (auto [ac, conv] : {std::pair{ActivationCheckpoint::Mode::none, false},
                          {ActivationCheckpoint::Mode::full, false},
                          {ActivationCheckpoint::Mode::none, true},
                          {ActivationCheckpoint::Mode::full, true}}) {
    SCOPED_TRACE(str_cat("AC ", int(ac), conv ? ", short conv" : ""));
    // With the convolution each segment reads the previous one's last 3 rows, on the other rank
    // for every segment boundary but the middle one.
    const GlaConfig c = test::tiny_gla_config(101, conv);
    const int64_t B = 2, T = 84;  // 4 segments of 21 tokens: partial chunks inside each
    const auto tok = test::random_tokens(B * (T + 1), c.vocab_size, 9);
    std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        in[size_t(b * T + t)] = tok[size_t(b * (T + 1) + t)];
        tg[size_t(b * T + t)] = tok[size_t(b * (T + 1) + t + 1)];
      }
    GlaModel one(c, DType::f32);
    one.init_weights(5);
    one.zero_grad();
    const double loss1 = one.forward_backward(in.data(), tg.data(), B, T, 0.01f);

    const auto pos = cp_positions(T, cpn, rank);
    const int64_t Tl = int64_t(pos.size());
    std::vector<int32_t> lin(size_t(B * Tl)), ltg(size_t(B * Tl));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tl; ++t) {
        lin[size_t(b * Tl + t)] = in[size_t(b * T + pos[size_t(t)])];
        ltg[size_t(b * Tl + t)] = tg[size_t(b * T + pos[size_t(t)])];
      }
    CpOptions cp;
    cp.group = group.get();
    GlaModel split(c, DType::f32, Device::cpu, {}, {}, cp);
    split.set_activation_checkpoint({ac, 1});
    split.init_weights(5);
    split.zero_grad();
    Tensor loss = Tensor::empty({1}, DType::f32);
    loss.data<float>()[0] = float(split.forward_backward(lin.data(), ltg.data(), B, Tl, 0.01f));
    group->all_reduce(loss, dist::ReduceOp::sum)->wait();
    EXPECT_LT(std::abs(loss.data<float>()[0] - loss1) / std::abs(loss1), 1e-5);
    auto u1 = one.units(), u2 = split.units();
    for (size_t i = 0; i < u1.size(); ++i) {
      group->all_reduce(u2[i]->grad_flat(), dist::ReduceOp::sum)->wait();
      for (size_t j = 0; j < u1[i]->params().size(); ++j) {
        const Param& p1 = u1[i]->params()[j];
        const Param& p2 = u2[i]->params()[j];
        const float* g1 = p1.grad.data<float>();
        const float* g2 = p2.grad.data<float>();
        EXPECT_LT(test::rel_l2(std::vector<float>(g2, g2 + p2.grad.numel()),
                               std::vector<float>(g1, g1 + p1.grad.numel())),
                  1e-5)
            << p2.spec.name;
      }
    }
  }
}

TEST(GlaContextParallel, ShortConvRefusesSegmentsShorterThanItsWindow) {
  auto group = dist::make_mpi_world_group("cp");
  GlaConfig c;
  c.hidden_size = 64;
  c.num_hidden_layers = 1;
  c.intermediate_size = 96;
  c.vocab_size = 101;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.use_short_conv = true;
  CpOptions cp;
  cp.group = group.get();
  GlaModel m(c, DType::f32, Device::cpu, {}, {}, cp);
  m.init_weights(1);
  // 8 tokens over 2 ranks: segments of 2 tokens, shorter than conv_size - 1 = 3.
  const auto tok = test::random_tokens(9, c.vocab_size, 2);
  test::expect_error([&] { m.forward_backward(tok.data(), tok.data() + 1, 1, 4, 1.0f); },
                     {"short convolution", "conv_size - 1 = 3", "parallelism.cp"});
}
