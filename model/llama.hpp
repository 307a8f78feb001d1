#pragma once
// The Llama model (docs/design.md decision 1), a Model (model/model.hpp): an embedding unit,
// transformer blocks (model/llama_block.hpp) and a head unit. The layers it is built from
// are in parallel/layers (tensor and context parallelism, checkpointing), their kernels behind the
// device dispatch of ops/.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/head.hpp"
#include "model/llama_block.hpp"
#include "model/llama_config.hpp"
#include "model/llama_plan.hpp"
#include "model/model.hpp"
#include "model/param_unit.hpp"
#include "parallel/layers/activation_checkpoint.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

class LlamaModel final : public Model {
 public:
  // With tensor parallelism each unit holds this tp rank's slices of the parameters (global
  // names, local shapes; ParamSpec::split); a config whose heads, kv heads, ffn size or
  // vocabulary tp does not divide is refused.
  LlamaModel(const LlamaConfig& config, DType compute, Device device = Device::cpu,
             ShardLayout shard = {}, TpOptions tp = {}, CpOptions cp = {},
             std::vector<bool> used = {});

  const LlamaConfig& config() const { return config_; }

  const char* model_type() const override { return "llama"; }
  std::string config_json() const override { return config_.to_json(); }
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t hidden_size() const override { return config_.hidden_size; }
  bool tie_word_embeddings() const override { return config_.tie_word_embeddings; }
  std::span<const PlanEntry> tp_plan() const override { return llama_plan(); }
  std::string describe() const override;
  double flops_per_token(int64_t T) const override { return config_.flops_per_token(T); }

  // Rows per chunk of the fused output projection + loss: of f32 logits, and (bf16 on one tp
  // rank) of the bf16 logit gradients its backward GEMMs take at once
  // (cpu::LinearCrossEntropyArgs::grad_rows; 0: one chunk's). Policy: a share of the step's
  // memory the loss may take (model/llama_loss_chunks.cpp).
  struct LossChunks {
    int64_t rows = 0, grad_rows = 0;
  };
  static LossChunks loss_chunks(const LlamaConfig& c, int64_t B, int64_t T, DType compute);

 private:
  const ops::Rope& rope_for(int64_t T);
  void prepare(ActivationStore& s, int64_t span) override;
  void set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) override;
  Tensor embedding_forward(ActivationStore& s) override;
  void embedding_backward(ActivationStore& s, const Tensor& dx) override;
  Tensor block_forward(ActivationStore& s, size_t block, const Tensor& x) override;
  void block_backward(ActivationStore& s, size_t block, Tensor& dy) override;
  Tensor head_forward_backward(ActivationStore& s) override;
  int64_t vocab_begin() const {
    return loom::vocab_begin(config_.vocab_size, tp().rank(), tp().size());
  }

  LlamaConfig config_;
  std::vector<std::unique_ptr<LlamaBlock>> blocks_;
  ops::Rope rope_;
};

}  // namespace loom
