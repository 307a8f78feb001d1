// Sharded parameter units on one process: every rank's shard is the slice of the unsharded
// model's weights (bit for bit), from init and from a safetensors load, and the padding is zero.
#include <gtest/gtest.h>

#include <filesystem>

#include "model/llama.hpp"
#include "model/safetensors.hpp"

namespace loom {
namespace {

LlamaConfig tiny() {
  LlamaConfig c;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 37;  // odd sizes so that shards split rows and parameters
  return c;
}

// The shards of every rank, concatenated, against the unsharded flat buffer.
void expect_shards_match(const LlamaModel& full_const,
                         std::vector<std::unique_ptr<LlamaModel>>& shards) {
  auto& full = const_cast<LlamaModel&>(full_const);
  const auto fu = full.units();
  for (size_t i = 0; i < fu.size(); ++i) {
    const float* ref = fu[i]->flat().data<float>();
    const int64_t n = fu[i]->numel();
    for (auto& m : shards) {
      ParamUnit& u = *m->units()[i];
      ASSERT_TRUE(u.sharded());
      EXPECT_EQ(u.padded_numel() % u.shard_layout().count, 0);
      EXPECT_GE(u.padded_numel(), n);
      EXPECT_LT(u.padded_numel() - n, u.shard_layout().count);
      const float* s = u.master_shard().data<float>();
      for (int64_t k = 0; k < u.shard_numel(); ++k) {
        const int64_t g = u.shard_begin() + k;
        if (g < n)
          ASSERT_EQ(s[k], ref[g]) << u.name() << " element " << g;
        else
          ASSERT_EQ(s[k], 0.0f) << u.name() << " padding " << g;
      }
    }
  }
}

TEST(Shard, InitIsTheSliceOfTheUnshardedInit) {
  const LlamaConfig c = tiny();
  LlamaModel full(c, DType::f32);
  full.init_weights(7);
  for (int n : {2, 3, 5, 8}) {
    std::vector<std::unique_ptr<LlamaModel>> shards;
    for (int r = 0; r < n; ++r) {
      shards.push_back(
          std::make_unique<LlamaModel>(c, DType::bf16, Device::cpu, ShardLayout{r, n}));
      shards.back()->init_weights(7);
    }
    expect_shards_match(full, shards);
  }
}

TEST(Shard, LoadReadsTheSlices) {
  const LlamaConfig c = tiny();
  LlamaModel full(c, DType::f32);
  full.init_weights(11);
  const auto dir =
      std::filesystem::temp_directory_path() / ("loom_shard_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<NamedTensor> w;
  for (ParamUnit* u : full.units())
    for (const Param& p : u->params()) w.push_back({p.spec.name, p.value});
  write_safetensors_dir(dir.string(), w);
  std::vector<std::unique_ptr<LlamaModel>> shards;
  for (int r = 0; r < 3; ++r) {
    shards.push_back(std::make_unique<LlamaModel>(c, DType::f32, Device::cpu, ShardLayout{r, 3}));
    shards.back()->load_hf(SafetensorsDir(dir.string()));
  }
  std::filesystem::remove_all(dir);
  expect_shards_match(full, shards);
}

TEST(Shard, GatherInputAndSideBufferCarryTheShard) {
  // A bf16 block gathers in bf16 with its norm weights in an f32 side buffer; summing the side
  // buffers of all ranks (what the all-reduce does) gives the exact f32 norm weights.
  const LlamaConfig c = tiny();
  LlamaModel full(c, DType::bf16);
  full.init_weights(3);
  ParamUnit& ref = *full.units()[1];
  for (auto& p : ref.params()) {  // norm weights other than 1, so a wrong slice shows
    if (!p.spec.f32_value) continue;
    for (int64_t k = 0; k < p.value.numel(); ++k)
      p.value.data<float>()[k] = 1.0f + 0.001f * float(k);
  }
  ref.refresh_bf16();
  const int n = 3;
  std::vector<float> side_sum;
  std::vector<bf16> gathered(size_t(ref.numel() + n), bf16{});
  for (int r = 0; r < n; ++r) {
    LlamaModel m(c, DType::bf16, Device::cpu, ShardLayout{r, n});
    ParamUnit& u = *m.units()[1];
    // The shard as the reference holds it.
    for (const ShardSlice& s : u.shard_slices())
      std::copy_n(ref.params()[s.param].value.data<float>() + s.begin, s.count,
                  u.master_shard().data<float>() + s.shard_offset);
    u.materialize_weights();
    ASSERT_EQ(u.gather_dtype(), DType::bf16);
    ASSERT_TRUE(u.needs_side());
    const Tensor in = u.gather_input();
    std::copy_n(in.data<bf16>(), u.shard_numel(), gathered.begin() + u.shard_begin());
    const Tensor& side = u.side_f32();
    side_sum.resize(size_t(side.numel()), 0.0f);
    for (int64_t k = 0; k < side.numel(); ++k) side_sum[size_t(k)] += side.data<float>()[k];
    u.release_weights();
    EXPECT_FALSE(u.weights_materialized());
  }
  for (int64_t k = 0; k < ref.numel(); ++k)
    ASSERT_EQ(gathered[size_t(k)].bits, ref.flat_bf16().data<bf16>()[k].bits) << k;
  const int64_t d = c.hidden_size;
  for (int64_t k = 0; k < d; ++k) {
    EXPECT_EQ(side_sum[size_t(k)], ref.params()[kNorm1].value.data<float>()[k]);
    EXPECT_EQ(side_sum[size_t(d + k)], ref.params()[kNorm2].value.data<float>()[k]);
  }
}

TEST(Shard, ShardedModelNeedsHooks) {
  LlamaModel m(tiny(), DType::f32, Device::cpu, ShardLayout{0, 2});
  std::vector<int32_t> tok(8, 1);
  EXPECT_THROW(m.forward_backward(tok.data(), tok.data(), 1, 8, 1.0f), Error);
}

}  // namespace
}  // namespace loom
