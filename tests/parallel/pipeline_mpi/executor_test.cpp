// The pipeline executor over real MPI ranks (one pp rank each) against one process: every rank
// also runs the whole model with grad_accum_steps = m on the same micro-batches, and the units of
// its stages must hold the same gradient bits, the head's rank the same summed loss bits, every
// rank the same gradient norm bits, for gpipe, 1f1b, interleaved_1f1b (balanced and explicit
// uneven splits), zb1p and zbv (I/W). A mixture of experts likewise, its router statistics and
// auxiliary loss gradient travelling as the model's carry, and its step metrics on the head's
// rank those of one process. The anti-tests feed a micro-batch's activation to its neighbour,
// drop the W steps' weight gradients and drop the carries beside the gradients, which the
// comparison must catch on some rank.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "distributed/group_sum.hpp"
#include "distributed/mpi_process_group.hpp"
#include "model/llama.hpp"
#include "model/model_config.hpp"
#include "model/moe.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/stage_split.hpp"
#include "parallel/pipeline_executor.hpp"
#include "tests/test_util.hpp"
#include "train/optimizer.hpp"

using namespace loom;

namespace {

constexpr int64_t kB = 2, kT = 8;

LlamaConfig config(int layers) {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 72;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 61;
  c.max_position_embeddings = 64;
  return c;
}

dist::ProcessGroup& world() {
  static std::unique_ptr<dist::ProcessGroup> g = [] {
    auto w = dist::make_mpi_world_group();
    w->set_timeout_seconds(60);
    return w;
  }();
  return *g;
}

struct Data {
  std::vector<std::vector<int32_t>> in, tg;
  explicit Data(int m, int vocab) {
    for (int j = 0; j < m; ++j) {
      in.push_back(test::random_tokens(kB * kT, vocab, 100 + uint64_t(j)));
      tg.push_back(test::random_tokens(kB * kT, vocab, 200 + uint64_t(j)));
    }
  }
};

// One process's run of the m micro-batches (grad_accum_steps = m) on `ref`: its summed loss.
// Both models start from the same weights with zero gradients.
double reference_run(Model& ref, Model& model, const Data& data, int m, float scale) {
  double loss = 0;
  for (Model* x : {&ref, &model}) {
    x->init_weights(7);
    x->zero_grad();
  }
  for (int j = 0; j < m; ++j)
    loss +=
        ref.forward_backward(data.in[size_t(j)].data(), data.tg[size_t(j)].data(), kB, kT, scale);
  return loss;
}

// The pipeline's run of the same micro-batches: the loss of those whose head is on this rank.
double pipeline_run(PipelineExecutor& ex, const Data& data, float scale) {
  return ex.run(
      [&](int j) {
        return MicroBatchView{data.in[size_t(j)].data(), data.tg[size_t(j)].data(), kB, kT};
      },
      scale);
}

// 1 where this rank's loss (on the head's rank), the gradients of its stages' units or the
// gradient norm differ from one process's, summed over the group; `anti`: mismatches are expected,
// not failures.
int mismatches_on_ranks(const PipelineExecutor& ex, Model& model, Model& ref, double loss,
                        double ref_loss, bool anti) {
  int bad = 0;
  if (ex.holds_head() && std::memcmp(&loss, &ref_loss, sizeof loss) != 0) {
    if (!anti) ADD_FAILURE() << "rank " << ex.rank() << ": loss " << loss << " vs " << ref_loss;
    bad = 1;
  }
  if (!ex.holds_head()) {
    EXPECT_EQ(loss, 0.0);
  }
  auto ru = ref.units(), mu = model.units();
  for (size_t u : ex.owned_units()) {
    const Tensor& a = mu[u]->grad_flat();
    const Tensor& b = ru[u]->grad_flat();
    if (std::memcmp(a.data<float>(), b.data<float>(), a.nbytes()) != 0) {
      if (!anti)
        ADD_FAILURE() << "rank " << ex.rank() << ": unit " << u << " gradient differs, rel L2 "
                      << test::rel_l2(
                             std::vector<float>(a.data<float>(), a.data<float>() + a.numel()),
                             std::vector<float>(b.data<float>(), b.data<float>() + b.numel()));
      bad = 1;
    }
  }
  // The gradient norm over pp (each unit's squared sum from its owner, added in unit order) has
  // the bits of one process's.
  const double norm =
      clip_grad_norm(model.units(), 0, nullptr, nullptr, &world(), ex.counted_units());
  const double ref_norm = clip_grad_norm(ref.units(), 0);
  if (std::memcmp(&norm, &ref_norm, sizeof norm) != 0) {
    if (!anti)
      ADD_FAILURE() << "rank " << ex.rank() << ": gradient norm " << norm << " vs " << ref_norm;
    bad = 1;
  }
  return int(group_sum(&world(), double(bad)));
}

// Number of ranks (summed over the group) whose gradients or loss differ from one process.
int mismatches(pp::ScheduleKind kind, int v, int m, int layers, const std::vector<int>& split,
               bool swap, bool drop_w = false) {
  const int p = world().size();
  const LlamaConfig c = config(layers);
  const Data data(m, int(c.vocab_size));
  const float scale = float(1.0 / double(m * kB * kT));

  LlamaModel ref(c, DType::f32), model(c, DType::f32);
  const double ref_loss = reference_run(ref, model, data, m, scale);
  PipelineExecutor ex(model, pp::make_schedule(kind, p, v, m),
                      pp::stage_units(layers, p * v, split), &world());
  ex.set_swap_activations(swap);
  ex.set_drop_weight_grads(drop_w);
  const double loss = pipeline_run(ex, data, scale);
  return mismatches_on_ranks(ex, model, ref, loss, ref_loss, swap || drop_w);
}

TEST(PipelineExecutor, GpipeBitwise) {
  const int p = world().size();
  EXPECT_EQ(mismatches(pp::ScheduleKind::gpipe, 1, p, 2 * p, {}, false), 0);
  EXPECT_EQ(mismatches(pp::ScheduleKind::gpipe, 1, 2 * p + 1, 2 * p, {}, false), 0);
  if (p > 1) {
    EXPECT_EQ(mismatches(pp::ScheduleKind::gpipe, 1, p - 1, 2 * p, {}, false), 0);
  }
}

TEST(PipelineExecutor, OneFOneBBitwise) {
  const int p = world().size();
  EXPECT_EQ(mismatches(pp::ScheduleKind::one_f_one_b, 1, p, 2 * p, {}, false), 0);
  EXPECT_EQ(mismatches(pp::ScheduleKind::one_f_one_b, 1, 3 * p + 1, 2 * p, {}, false), 0);
}

TEST(PipelineExecutor, InterleavedBitwise) {
  const int p = world().size();
  EXPECT_EQ(mismatches(pp::ScheduleKind::interleaved_1f1b, 2, 2 * p, 2 * p, {}, false), 0);
  EXPECT_EQ(mismatches(pp::ScheduleKind::interleaved_1f1b, 4, p, 4 * p, {}, false), 0);
}

TEST(PipelineExecutor, UnevenSplitBitwise) {
  // One block on the first stage, the rest spread: an explicit pp_stage_layers.
  const int p = world().size();
  std::vector<int> split(size_t(p), 2);
  split[0] = 1;
  split.back() = 3;
  int layers = 0;
  for (int n : split) layers += n;
  EXPECT_EQ(mismatches(pp::ScheduleKind::one_f_one_b, 1, 2 * p, layers, split, false), 0);
}

TEST(PipelineExecutor, AntiTestSwappedActivationIsCaught) {
  const int p = world().size();
  if (p == 1) GTEST_SKIP() << "no activation crosses ranks with one rank";
  EXPECT_GT(mismatches(pp::ScheduleKind::one_f_one_b, 1, 2 * p, 2 * p, {}, true), 0);
}

}  // namespace

namespace {

TEST(PipelineExecutor, ZeroBubbleBitwise) {
  // I runs the input gradient with every linear layer's dW deferred, W runs them from the saved
  // operands: each weight gets the same additions in the same order as one process.
  const int p = world().size();
  EXPECT_EQ(mismatches(pp::ScheduleKind::zb1p, 1, p, 2 * p, {}, false), 0);
  EXPECT_EQ(mismatches(pp::ScheduleKind::zb1p, 1, 2 * p + 1, 2 * p, {}, false), 0);
  EXPECT_EQ(mismatches(pp::ScheduleKind::zbv, 2, 2 * p, 2 * p, {}, false), 0);
}

TEST(PipelineExecutor, AntiTestDroppedWeightGradientIsCaught) {
  const int p = world().size();
  EXPECT_GT(mismatches(pp::ScheduleKind::zb1p, 1, p, 2 * p, {}, false, true), 0);
}

// Tied embeddings with the first and last stages on different ranks: the last stage's head writes
// its replica of the embedding and sum_tied_gradients() exchanges and adds the two. Returns the
// worst relative L2 (over the ranks) of the embedding's gradient against one process on the first
// and last ranks, after checking that every other owned unit, the loss and the two copies agree
// bit for bit. The sum's order (embedding's micro-batches, then the head's) differs from one
// process's interleaving, so the embedding is compared within a tolerance.
double tied_embedding_error(pp::ScheduleKind kind, int v, int m, bool skip_sum) {
  const int p = world().size();
  const int layers = 2 * p;
  LlamaConfig c = config(layers);
  c.tie_word_embeddings = true;
  const Data data(m, int(c.vocab_size));
  const float scale = float(1.0 / double(m * kB * kT));
  LlamaModel ref(c, DType::f32), model(c, DType::f32);
  const double ref_loss = reference_run(ref, model, data, m, scale);
  PipelineExecutor ex(model, pp::make_schedule(kind, p, v, m), pp::stage_units(layers, p * v),
                      &world());
  EXPECT_TRUE(ex.tied_across_ranks());
  ex.set_skip_tied_sum(skip_sum);
  const double loss = pipeline_run(ex, data, scale);
  ex.sum_tied_gradients();
  if (ex.holds_head()) {
    EXPECT_EQ(std::memcmp(&loss, &ref_loss, sizeof loss), 0) << loss << " vs " << ref_loss;
  }
  auto ru = ref.units(), mu = model.units();
  auto values = [](const Tensor& t) {
    return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
  };
  for (size_t u : ex.owned_units()) {
    if (u == 0) continue;
    EXPECT_EQ(std::memcmp(mu[u]->grad_flat().data<float>(), ru[u]->grad_flat().data<float>(),
                          mu[u]->grad_flat().nbytes()),
              0)
        << "rank " << ex.rank() << " unit " << u;
  }
  double err = 0;
  const auto& ranks = ex.schedule().stage_rank;
  if (ex.rank() == ranks.front() || ex.rank() == ranks.back())
    err = test::rel_l2(values(mu[0]->grad_flat()), values(ru[0]->grad_flat()));
  // The two copies must hold the same bits (they take the same update): compared across ranks
  // through the exact group sum of a checksum (0 elsewhere).
  double sum = 0;
  if (ex.rank() == ranks.front() || ex.rank() == ranks.back())
    for (float x : values(mu[0]->grad_flat())) sum += double(x);
  const double first_sum = group_sum(&world(), ex.rank() == ranks.front() ? sum : 0.0);
  const double last_sum = group_sum(&world(), ex.rank() == ranks.back() ? sum : 0.0);
  if (!skip_sum) {
    EXPECT_EQ(first_sum, last_sum);
    // The norm counts the embedding once (its replica is not counted).
    const double norm =
        clip_grad_norm(model.units(), 0, nullptr, nullptr, &world(), ex.counted_units());
    EXPECT_NEAR(norm, clip_grad_norm(ref.units(), 0), 1e-6 * norm);
  }
  // The worst over ranks: the sum of the errors of the two ranks that hold copies bounds it.
  return group_sum(&world(), err);
}

TEST(PipelineExecutor, TiedEmbeddingsSummedAcrossFirstAndLastRanks) {
  const int p = world().size();
  if (p == 1) GTEST_SKIP() << "one rank holds both ends";
  EXPECT_LT(tied_embedding_error(pp::ScheduleKind::one_f_one_b, 1, 2 * p, false), 1e-6);
  EXPECT_LT(tied_embedding_error(pp::ScheduleKind::gpipe, 1, p, false), 1e-6);
  EXPECT_LT(tied_embedding_error(pp::ScheduleKind::interleaved_1f1b, 2, 2 * p, false), 1e-6);
}

TEST(PipelineExecutor, AntiTestSkippedTiedSumIsCaught) {
  const int p = world().size();
  if (p == 1) GTEST_SKIP() << "one rank holds both ends";
  EXPECT_GT(tied_embedding_error(pp::ScheduleKind::one_f_one_b, 1, 2 * p, true), 1e-2);
}

// A mixture of experts shaped as Qwen3-MoE (a dense first layer, then sparse layers of two blocks
// each that a stage keeps together), its auxiliary loss trained with a large coefficient so that
// its gradient shows in the routers'.
MoeConfig moe_config(int layers) {
  MoeConfig c;
  c.base = config(layers);
  c.base.intermediate_size = 48;
  c.head_dim = 8;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 24;
  c.norm_topk_prob = true;
  c.mlp_only_layers = {0};
  c.router_aux_loss_coef = 0.5;
  c.output_router_logits = true;
  return c;
}

// As mismatches(), and the step's metrics: on the head's rank those of one process (the
// statistics of every stage's sparse layers travelled to it), zeros elsewhere. `drop_carries`:
// the anti-test (the auxiliary loss's gradient stays on the head's rank).
int moe_mismatches(pp::ScheduleKind kind, int v, int m, int layers, bool drop_carries) {
  const int p = world().size();
  const MoeConfig c = moe_config(layers);
  const Data data(m, int(c.base.vocab_size));
  const float scale = float(1.0 / double(m * kB * kT));
  MoeModel ref(c, DType::f32), model(c, DType::f32);
  const double ref_loss = reference_run(ref, model, data, m, scale);
  PipelineExecutor ex(
      model, pp::make_schedule(kind, p, v, m),
      pp::layer_ranges_to_blocks(pp::stage_units(layers, p * v), ModelConfig(c).blocks_per_layer()),
      &world());
  ex.set_drop_backward_carries(drop_carries);
  const double loss = pipeline_run(ex, data, scale);
  const int bad = mismatches_on_ranks(ex, model, ref, loss, ref_loss, drop_carries);
  const auto got = model.take_step_metrics(), want = ref.take_step_metrics();
  int off = got.size() != want.size() || want.size() != 3;
  for (size_t i = 0; !off && i < got.size(); ++i) {
    const double w = ex.holds_head() ? want[i].value : 0.0;
    if (got[i].name == want[i].name && std::memcmp(&got[i].value, &w, sizeof w) == 0) continue;
    if (!drop_carries)
      ADD_FAILURE() << "rank " << ex.rank() << ": " << got[i].name << " " << got[i].value << " vs "
                    << w;
    off = 1;
  }
  EXPECT_TRUE(drop_carries || got.size() == want.size()) << "rank " << ex.rank();
  // The step's expert loads (for the bias and the runaway warning): on every rank one process's,
  // summed over pp from the head's rank.
  model.after_update(nullptr, &world());
  ref.after_update(nullptr, nullptr);
  if (model.balance().step_loads() != ref.balance().step_loads()) {
    if (!drop_carries) ADD_FAILURE() << "rank " << ex.rank() << ": the step's expert loads differ";
    off = 1;
  }
  return bad + int(group_sum(&world(), double(off)));
}

TEST(PipelineExecutor, MixtureOfExpertsBitwise) {
  const int p = world().size();
  EXPECT_EQ(moe_mismatches(pp::ScheduleKind::one_f_one_b, 1, 2 * p, 2 * p, false), 0);
  EXPECT_EQ(moe_mismatches(pp::ScheduleKind::gpipe, 1, p, 2 * p, false), 0);
  EXPECT_EQ(moe_mismatches(pp::ScheduleKind::interleaved_1f1b, 2, 2 * p, 2 * p, false), 0);
  EXPECT_EQ(moe_mismatches(pp::ScheduleKind::zb1p, 1, 2 * p, 2 * p, false), 0);
  EXPECT_EQ(moe_mismatches(pp::ScheduleKind::zbv, 2, 2 * p, 2 * p, false), 0);
}

TEST(PipelineExecutor, AntiTestDroppedGradientCarryIsCaught) {
  const int p = world().size();
  if (p == 1) GTEST_SKIP() << "no stage boundary crosses ranks with one rank";
  EXPECT_GT(moe_mismatches(pp::ScheduleKind::one_f_one_b, 1, 2 * p, 2 * p, true), 0);
}

}  // namespace

namespace {

// Run only by pipeline_mpi_timeout (tests/parallel/pipeline_mpi/timeout_test.sh): the last rank
// stops before its first action; the others must end the job with the timeout line naming the
// schedule, action, stage, micro-batch and peer, instead of hanging.
TEST(PipelineExecutor, DISABLED_StoppedRankEndsTheJobWithTheTimeoutLine) {
  const int p = world().size();
  world().set_timeout_seconds(2);
  if (world().rank() == p - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // killed by the others' abort
    return;
  }
  LlamaModel model(config(p), DType::f32);
  model.init_weights(7);
  const Data data(p, int(model.config().vocab_size));
  PipelineExecutor ex(model, pp::make_schedule(pp::ScheduleKind::one_f_one_b, p, 1, p),
                      pp::stage_units(p, p), &world());
  ex.run(
      [&](int j) {
        return MicroBatchView{data.in[size_t(j)].data(), data.tg[size_t(j)].data(), kB, kT};
      },
      1.0f);
  ADD_FAILURE() << "the step finished although rank " << p - 1 << " never ran";
}

}  // namespace
