// parallel/ on one process: the mesh's questions (ParallelDims), the Llama TP plan against the
// model's own split of every parameter, the zigzag CP slice of a batch, and the cost oracle
// (tests/support/cost_oracle.hpp) of a model built on the meta device against the same model
// allocated.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "model/gla.hpp"
#include "model/gla_plan.hpp"
#include "model/llama.hpp"
#include "model/llama_plan.hpp"
#include "model/tp_plan.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/parallel_dims.hpp"
#include "parallel/parallelize.hpp"
#include "tests/support/cost_oracle.hpp"

namespace loom {
namespace {

// configs/debug.json: 2 layers of dim 64, 4/2 heads (LOOM_SOURCE_DIR is set by ctest).
LlamaConfig tiny() {
  const char* src = std::getenv("LOOM_SOURCE_DIR");
  return LlamaConfig::from_file(std::string(src ? src : ".") + "/configs/debug.json");
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ParallelDims, SizesGroupsAndDivisors) {
  ParallelDims d;
  d.dp_replicate = 2;
  d.cp = 2;
  d.tp = 2;
  EXPECT_EQ(d.asked(), 8);
  const ParallelDims r = d.resolved(16);
  EXPECT_EQ(r.dp_shard, 2);
  EXPECT_EQ(r.world(), 16);
  EXPECT_EQ(r.dp(), 4);
  EXPECT_EQ(r.fsdp(), 4);  // dp_shard x cp
  EXPECT_TRUE(r.hsdp_enabled());
  EXPECT_FALSE(r.ddp_enabled());
  EXPECT_EQ(r.seq_divisor(), 8);  // 2 cp x tp (sequence parallel)
  ParallelDims no_sp = r;
  no_sp.sequence_parallel = false;
  EXPECT_EQ(no_sp.seq_divisor(), 4);
  EXPECT_EQ(r.local_seq_len(256), 128);
}

TEST(ParallelDims, ValidationMessages) {
  ParallelDims d;
  d.tp = 2;
  EXPECT_NE(error_of([&] { d.validate(64, true); }).find("needs 2 ranks, but this is one process"),
            std::string::npos);
  EXPECT_NE(error_of([&] { d.check_launched(false, "train"); }).find("mpirun -np 2 loom train"),
            std::string::npos);
  d.tp = 1;
  d.pp = 2;
  EXPECT_TRUE(error_of([&] { d.validate(64, false); }).empty());  // pp alone (or with tp) runs
  d.pp = 1;
  d.cp = 2;
  EXPECT_FALSE(error_of([&] { d.validate(66, false); }).empty());  // 66 is not a multiple of 4
  EXPECT_TRUE(error_of([&] { d.validate(64, false); }).empty());
}

TEST(LlamaPlan, MatchesTheModelsSplits) {
  EXPECT_TRUE(
      plan_matches("model.layers.*.mlp.up_proj.weight", "model.layers.12.mlp.up_proj.weight"));
  EXPECT_FALSE(
      plan_matches("model.layers.*.mlp.up_proj.weight", "model.layers..mlp.up_proj.weight"));
  EXPECT_FALSE(plan_matches("model.norm.weight", "model.norm.weight.x"));
  LlamaModel m(tiny(), DType::f32, Device::meta);
  EXPECT_TRUE(error_of([&] { check_plan(m, llama_plan()); }).empty());
  // The model's own plan is the source of its splits, looked up by name.
  EXPECT_EQ(m.tp_plan().data(), llama_plan().data());
  EXPECT_EQ(split_of(m.tp_plan(), "model.layers.3.self_attn.o_proj.weight"), TpSplit::cols);
  EXPECT_NE(error_of([&] {
              split_of(m.tp_plan(), "model.layers.0.mlp.w3.weight");
            }).find("model.layers.0.mlp.w3.weight has no entry in the plan"),
            std::string::npos);
  // A plan that disagrees with the model, or misses a parameter, is refused by name.
  std::vector<PlanEntry> plan(llama_plan().begin(), llama_plan().end());
  for (PlanEntry& e : plan)
    if (std::string(e.pattern).find("o_proj") != std::string::npos) e.style = TpStyle::column;
  EXPECT_NE(error_of([&] {
              check_plan(m, plan);
            }).find("model.layers.0.self_attn.o_proj.weight is row-parallel but the plan"),
            std::string::npos);
  plan.pop_back();  // lm_head
  plan.erase(plan.begin());
  EXPECT_NE(error_of([&] {
              check_plan(m, plan);
            }).find("model.embed_tokens.weight has no entry in the plan"),
            std::string::npos);
}

// GLA's plan agrees with the model's splits (with the short convolution and without the output
// gate's norm fusion too), and Llama's plan is refused on it by name.
TEST(GlaPlan, MatchesTheModelsSplits) {
  for (bool conv : {false, true}) {
    GlaConfig c;
    c.hidden_size = 32;
    c.num_hidden_layers = 2;
    c.num_heads = 2;
    c.num_kv_heads = 2;
    c.intermediate_size = 48;
    c.vocab_size = 64;
    c.use_short_conv = conv;
    c.fuse_norm = conv;
    GlaModel m(c, DType::f32, Device::meta);
    EXPECT_TRUE(error_of([&] { check_plan(m, gla_plan()); }).empty());
    EXPECT_NE(error_of([&] {
                check_plan(m, llama_plan());
              }).find("model.embeddings.weight has no entry in the plan"),
              std::string::npos);
  }
}

// CPU offload keeps FSDP's shards on the host: a model nothing shards cannot offload (its GEMMs
// read its weights in place), and the error names the key.
TEST(Parallelize, CpuOffloadNeedsShardedStates) {
  ParallelizeOptions o;
  o.device = Device::meta;
  o.cpu_offload = true;
  const std::string e = error_of([&] { parallelize(ModelConfig(tiny()), DType::f32, {}, o); });
  EXPECT_NE(e.find("training.enable_cpu_offload"), std::string::npos) << e;
}

TEST(Parallelize, CpLocalBatchTakesTheZigzagChunks) {
  const int64_t B = 2, T = 8;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    in[size_t(i)] = int32_t(i);
    tg[size_t(i)] = int32_t(100 + i);
  }
  const LocalBatch r1 = cp_local_batch(in.data(), tg.data(), B, T, 2, 1, 1);
  // cp 2: four chunks of 2; rank 1 holds chunks 1 and 2 of every sample.
  EXPECT_EQ(r1.T, 4);
  EXPECT_EQ(r1.inputs, (std::vector<int32_t>{2, 3, 4, 5, 10, 11, 12, 13}));
  EXPECT_EQ(r1.targets[0], 102);
  const auto pos = cp_positions(T, 2, 0, 1);
  const LocalBatch r0 = cp_local_batch(in.data(), tg.data(), B, T, 2, 0, 1);
  for (size_t t = 0; t < pos.size(); ++t) EXPECT_EQ(r0.inputs[t], int32_t(pos[t]));
}

// A pipeline stage's share of the memory is priced per unit: without checkpointing the blocks'
// saved activations add up to the whole model's, with `op` to it less the one recomputed act
// that the whole-model figure adds, and the head's saved input plus its backward's buffers are
// its workspace; the embedding saves nothing (its output is block 0's input).
TEST(CostOracle, UnitActivationsAddUpToTheModel) {
  const int64_t B = 2, T = 16;
  for (DType dt : {DType::f32, DType::bf16})
    for (const char* mode : {"none", "op"}) {
      ParallelizeOptions o;
      o.device = Device::meta;
      o.ac = ActivationCheckpoint::parse(std::string(mode) == "op" ? "selective" : "none", mode);
      ParallelModel plan = parallelize(tiny(), dt, {}, o);
      const Model& m = *plan.model;
      size_t blocks = 0;
      for (size_t u = 1; u + 1 < m.num_units(); ++u) {
        const oracle::UnitActivations a = oracle::unit_activation_bytes(m, u, B, T);
        blocks += a.saved;
        EXPECT_GT(a.backward, 0u);
        EXPECT_GT(a.deferred, 0u);
      }
      EXPECT_EQ(blocks, oracle::saved_at_head_bytes(m, B, T)) << mode;
      const oracle::UnitActivations head =
          oracle::unit_activation_bytes(m, m.num_units() - 1, B, T);
      EXPECT_EQ(head.saved, size_t(B * T * tiny().hidden_size * 4));
      EXPECT_EQ(head.saved + head.backward, oracle::head_workspace_bytes(m, B, T));
      EXPECT_EQ(oracle::unit_activation_bytes(m, 0, B, T).saved, 0u);
    }
}

// The peak within the blocks' backward, where FSDP prices its block-time buffers, lies between
// what the blocks saved and the peak of the whole step.
TEST(CostOracle, BackwardPeakLiesBetweenTheSavedSetAndThePeak) {
  const int64_t B = 2, T = 16;
  for (DType dt : {DType::f32, DType::bf16})
    for (const char* mode : {"none", "op", "full"}) {
      ParallelizeOptions o;
      o.device = Device::meta;
      o.ac = std::string(mode) == "op"     ? ActivationCheckpoint::parse("selective", "op")
             : std::string(mode) == "full" ? ActivationCheckpoint::parse("full", "op")
                                           : ActivationCheckpoint::parse("none", "op");
      ParallelModel plan = parallelize(tiny(), dt, {}, o);
      const Model& m = *plan.model;
      EXPECT_GT(oracle::backward_peak_bytes(m, B, T), oracle::saved_at_head_bytes(m, B, T)) << mode;
      EXPECT_LE(oracle::backward_peak_bytes(m, B, T), oracle::saved_activation_bytes(m, B, T))
          << mode;
    }
}

TEST(CostOracle, MetaModelPricesLikeTheAllocatedOne) {
  for (DType dt : {DType::f32, DType::bf16}) {
    ParallelizeOptions o;
    o.ac = ActivationCheckpoint::parse("selective", "op");
    ParallelModel real = parallelize(tiny(), dt, {}, o);
    o.device = Device::meta;
    ParallelModel plan = parallelize(tiny(), dt, {}, o);
    EXPECT_EQ(real.model->units()[0]->device(), Device::cpu);
    const oracle::MemoryCost a = oracle::memory_cost(plan, 2, 16);
    const oracle::MemoryCost b = oracle::memory_cost(real, 2, 16);
    EXPECT_EQ(a.total(), b.total());
    EXPECT_EQ(a.states(), size_t(real.model->num_params()) * (dt == DType::bf16 ? 18 : 16));
    EXPECT_EQ(a.activations,
              oracle::llama_activations(tiny(), 2, 16, dt, 1, false, false, o.ac).peak);
    EXPECT_EQ(a.comm + a.ring + a.gathered + a.full_grad, 0u);  // one process
    EXPECT_EQ(oracle::bytes_per_step(plan, DType::f32, 2, 16, 1), 0u);
  }
}

}  // namespace
}  // namespace loom
