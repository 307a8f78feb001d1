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

  // Bytes of activations one micro-batch holds at its peak (the analytic figure of the memory
  // model): without checkpointing every block's saved tensors; with it, the larger of what the
  // blocks save and, for the last block recomputed in backward, what the blocks before it save
  // plus that block's recomputed tensors. With tensor parallelism (tp ranks, sequence parallel,
  // recompute_allgather): one tp rank's. (model/llama_cost.cpp)
  // In bf16 the peak also holds a block's f32 gate/up GEMM output beside its rounded copy (the
  // last block's forward, a recomputed block's forward), and what the allocator hands a saved
  // tensor beyond its size when it reuses the block's freed f32 qkv output.
  static size_t saved_activation_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                       int tp = 1, bool sp = false, bool recompute = false,
                                       const ActivationCheckpoint& ac = {});
  // What the blocks have saved when the head runs (the peak above is at a block instead when a
  // block's transients or recomputation exceed the head's workspace).
  static size_t saved_at_head_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                    int tp = 1, bool sp = false, bool recompute = false,
                                    const ActivationCheckpoint& ac = {});
  // The peak within the blocks' backward: the saved tensors then plus a block's working buffers
  // (and a recomputed block's whole set).
  static size_t backward_peak_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                    int tp = 1, bool sp = false, bool recompute = false,
                                    const ActivationCheckpoint& ac = {});
  size_t saved_activation_bytes(int64_t B, int64_t T) const override;
  size_t saved_at_head_bytes(int64_t B, int64_t T) const override;
  size_t backward_peak_bytes(int64_t B, int64_t T) const override;
  size_t head_workspace_bytes(int64_t B, int64_t T) const override;
  // The pooled communication buffers of tensor parallelism after a step: one per (purpose,
  // dtype, size) of the model's tp_pooled() calls.
  static size_t tp_comm_buffer_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                     int tp, bool sp);
  size_t tp_comm_buffer_bytes(int64_t B, int64_t T) const override;
  // Bytes this rank sends on the tp group in one micro-batch (the analytic figure).
  uint64_t tp_bytes_per_micro_batch(int64_t B, int64_t T,
                                    const std::vector<bool>& runs = {}) const override;
  // Bytes this rank sends on the cp group in one micro-batch of T tokens per sample on this rank
  // (ring attention's K/V, and dK/dV in backward; the analytic figure).
  uint64_t cp_bytes_per_micro_batch(int64_t B, int64_t T,
                                    const std::vector<bool>& runs = {}) const override;
  // Ring attention's working set in a block's backward, the largest it holds (0 without cp).
  size_t ring_working_bytes(int64_t B, int64_t T) const override;
  // Per unit: the embedding saves nothing (its output is block 0's input), a block what its
  // checkpointing mode keeps, the head its input (its workspace is its backward's).
  UnitActivations unit_activation_bytes(size_t unit, int64_t B, int64_t T) const override;
  // Rows per chunk of the fused output projection + loss: of f32 logits, and (bf16 on one tp
  // rank) of the bf16 logit gradients its backward GEMMs take at once
  // (cpu::LinearCrossEntropyArgs::grad_rows; 0: one chunk's).
  struct LossChunks {
    int64_t rows = 0, grad_rows = 0;
  };
  static LossChunks loss_chunks(const LlamaConfig& c, int64_t B, int64_t T, DType compute);

 private:
  const RopeTable& rope_for(int64_t T);
  void prepare(ActivationStore& s, int64_t span) override;
  void set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) override;
  Tensor embedding_forward(ActivationStore& s) override;
  void embedding_backward(ActivationStore& s, const Tensor& dx) override;
  Tensor block_forward(ActivationStore& s, size_t block, const Tensor& x) override;
  void block_backward(ActivationStore& s, size_t block, Tensor& dy) override;
  Tensor head_forward_backward(ActivationStore& s) override;
  int64_t vocab_rows() const { return local_vocab(config_.vocab_size, tp().size()); }
  int64_t vocab_begin() const { return int64_t(tp().rank()) * vocab_rows(); }
  size_t ring_kv_bytes(int64_t B, int64_t T) const;

  LlamaConfig config_;
  std::vector<std::unique_ptr<LlamaBlock>> blocks_;
  RopeTable rope_;
};

}  // namespace loom
