#pragma once
// The GLA model (fla's GLAForCausalLM), a Model (model/model.hpp): an embedding unit, GLA blocks
// (model/gla_block.hpp) and a head unit (final norm, output projection fused with the loss), with
// fla's parameter names. It shares LlamaModel's unit plumbing (hooks, so FSDP/HSDP/DDP), ops,
// kernels and tensor-parallel layers. Context parallelism passes the GLA state between segments.
// Under tensor parallelism the blocks hold their heads' slices (with sequence parallelism the
// residual stream holds this rank's rows); the embedding and the head are replicated (each rank
// computes the same loss and gradients for them).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/gla_block.hpp"
#include "model/gla_config.hpp"
#include "model/gla_plan.hpp"
#include "model/model.hpp"
#include "model/param_unit.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

class GlaModel final : public Model {
 public:
  // With context parallelism a micro-batch holds this cp rank's tokens (T = seq_len / cp, at
  // the zigzag positions of parallel/layers/context_parallel.hpp); its loss and gradients are this
  // rank's share (the caller sums them over cp, as FSDP does over dp_shard x cp).
  GlaModel(const GlaConfig& config, DType compute, Device device = Device::cpu,
           ShardLayout shard = {}, TpOptions tp = {}, CpOptions cp = {},
           std::vector<bool> used = {});

  const GlaConfig& config() const { return config_; }
  const GlaBlock& block(size_t l) const { return *blocks_[l]; }
  const ParamUnit& embedding() const { return embed_unit(); }
  const ParamUnit& head() const { return head_unit(); }
  int tp_size() const { return tp().size(); }
  int cp_size() const { return cp().size(); }

  const char* model_type() const override { return "gla"; }
  std::string config_json() const override { return config_.to_json(); }
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t hidden_size() const override { return config_.hidden_size; }
  bool tie_word_embeddings() const override { return config_.tie_word_embeddings; }
  std::span<const PlanEntry> tp_plan() const override { return gla_plan(); }
  std::string describe() const override;
  double flops_per_token(int64_t T) const override { return config_.flops_per_token(T); }
  // Every parameter from an fla-format checkpoint (config.json's model, fla's names), shapes
  // checked; under tensor parallelism each rank reads its slices, a sharded unit its shard's.
  // Tensors the model does not have are an error naming them (another variant of the model),
  // except the optimizer moments of a loom checkpoint (name.exp_avg, name.exp_avg_sq).
  void load_hf(const SafetensorsDir& dir) override;
  // fla-format weights (global tensors, fla's names) into `dir`/model*.safetensors and its
  // config.json. One process only.
  void save_hf(const std::string& dir);
  // Bytes the blocks saved in the last micro-batch, measured when its head ran (after every
  // block's forward, before their backward).
  size_t last_saved_activation_bytes() const { return saved_bytes_; }

 private:
  void prepare(ActivationStore& s, int64_t span) override;
  void set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) override;
  Tensor embedding_forward(ActivationStore& s) override;
  void embedding_backward(ActivationStore& s, const Tensor& dx) override;
  Tensor block_forward(ActivationStore& s, size_t block, const Tensor& x) override;
  void block_backward(ActivationStore& s, size_t block, Tensor& dy) override;
  Tensor head_forward_backward(ActivationStore& s) override;

  GlaConfig config_;
  std::vector<std::unique_ptr<GlaBlock>> blocks_;
  size_t saved_bytes_ = 0;
};

}  // namespace loom
