#pragma once
// The GLA model (fla's GLAForCausalLM): an embedding unit, GLA blocks (model/gla_block.hpp) and a
// head unit (final norm, output projection fused with the loss), with fla's parameter names.
// It shares LlamaModel's units, ops, kernels and tensor-parallel layers; not yet its hooks
// (FSDP). Context parallelism passes the GLA state between segments. Under tensor parallelism the
// blocks hold their heads' slices (with sequence parallelism the residual stream holds this rank's
// rows); the embedding and the head are replicated (each rank computes the same loss and gradients
// for them).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/buffer_pool.hpp"
#include "model/gla_block.hpp"
#include "model/gla_config.hpp"
#include "model/param_unit.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

class SafetensorsDir;

class GlaModel {
 public:
  // With context parallelism forward_backward takes this cp rank's tokens (T = seq_len / cp, at
  // the zigzag positions of parallel/layers/context_parallel.hpp); its loss and gradients are this
  // rank's share (the caller sums them over cp, as FSDP does over dp_shard x cp).
  GlaModel(const GlaConfig& config, DType compute, Device device = Device::cpu, TpOptions tp = {},
           CpOptions cp = {});

  const GlaConfig& config() const { return config_; }
  DType compute_dtype() const { return compute_; }
  const GlaBlock& block(size_t l) const { return *blocks_[l]; }
  size_t num_blocks() const { return blocks_.size(); }
  const ParamUnit& embedding() const { return *embed_; }
  const ParamUnit& head() const { return *head_; }
  std::vector<ParamUnit*> units();
  int64_t num_params() const;
  void init_weights(uint64_t seed);
  // Every parameter from an fla-format checkpoint (config.json's model, fla's names), shapes
  // checked; under tensor parallelism each rank reads its slices. Tensors the model does not
  // have are an error naming them (another variant of the model).
  void load_hf(const SafetensorsDir& dir);
  // fla-format weights (global tensors, fla's names) into `dir`/model*.safetensors and its
  // config.json. One process only.
  void save_hf(const std::string& dir);
  int tp_size() const { return par_->tp.opt.size(); }
  int cp_size() const { return par_->cp.size(); }
  // Activation checkpointing of every block (default: none).
  void set_activation_checkpoint(const ActivationCheckpoint& ac);
  // Bytes the blocks saved in the last forward_backward, measured before their backward.
  size_t last_saved_activation_bytes() const { return saved_bytes_; }
  void zero_grad();

  // inputs/targets [B, T]: gradients of (grad_scale * the summed loss) accumulate into the units;
  // returns the summed loss.
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale);

 private:
  GlaConfig config_;
  DType compute_;
  Device device_;
  dist::BufferPool pool_;
  std::unique_ptr<ParallelContext> par_;  // stable address: the blocks point at it
  std::unique_ptr<ParamUnit> embed_;
  std::vector<std::unique_ptr<GlaBlock>> blocks_;
  std::unique_ptr<ParamUnit> head_;
  size_t saved_bytes_ = 0;
};

}  // namespace loom
