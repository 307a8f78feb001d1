#pragma once
// The Llama model (DESIGN.md decision 1): an embedding unit, transformer blocks
// (model/transformer_block.hpp) and a head unit, run per micro-batch over any range of units, with
// the micro-batch's activations in an ActivationStore that lives between the calls. The layers it
// is built from are in parallel/layers (tensor and context parallelism, checkpointing), their
// kernels behind the device dispatch of ops/.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/buffer_pool.hpp"
#include "model/llama_config.hpp"
#include "model/param_unit.hpp"
#include "model/transformer_block.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/activation_checkpoint.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

class SafetensorsDir;

// Called by LlamaModel around the work of each unit, unit i in units() order (embedding, blocks,
// head). Data parallelism (parallel/) implements it: gathering sharded weights before a unit
// runs, reducing its gradient after its backward. The head's forward and backward are one fused
// computation: its after_forward is directly followed by its before_backward. With tied
// embeddings the head also reads and writes unit 0 (the embedding) between its before_backward
// and after_backward.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(size_t unit) = 0;
  virtual void after_forward(size_t unit) = 0;
  virtual void before_backward(size_t unit) = 0;
  virtual void after_backward(size_t unit) = 0;
};

// One micro-batch between its forward and its backward: the step context, the tokens, and what
// every unit's forward saved for its backward. A pipeline stage keeps one per micro-batch in
// flight. Made by LlamaModel::micro_batch; the token arrays must outlive it.
struct ActivationStore {
  StepContext ctx;
  const int32_t* inputs = nullptr;   // [B, T]
  const int32_t* targets = nullptr;  // [B, T]
  float grad_scale = 1;
  std::vector<BlockActs> blocks;  // block l's saved activations (unit l + 1)
  Tensor head_input;              // the last block's output, kept for the head's fused pass
  double loss = 0;                // the summed loss, once the head's backward ran
};

class LlamaModel {
 public:
  // With tensor parallelism each unit holds this tp rank's slices of the parameters (global
  // names, local shapes; ParamSpec::split); a config whose heads, kv heads, ffn size or
  // vocabulary tp does not divide is refused.
  LlamaModel(const LlamaConfig& config, DType compute, Device device = Device::cpu,
             ShardLayout shard = {}, TpOptions tp = {}, CpOptions cp = {});

  const LlamaConfig& config() const { return config_; }
  DType compute_dtype() const { return compute_; }
  Device device() const { return device_; }
  std::vector<ParamUnit*> units();
  size_t num_units() const { return blocks_.size() + 2; }
  int64_t num_params() const;

  const ShardLayout& shard_layout() const { return shard_; }
  const TpOptions& tp() const { return par_->tp.opt; }
  const CpOptions& cp() const { return par_->cp; }
  size_t comm_buffer_bytes() const { return pool_.bytes(); }
  // Not owned; nullptr for none. Must outlive the calls of forward/backward.
  void set_hooks(UnitHooks* hooks) { hooks_ = hooks; }
  // Activation checkpointing of every block (default: none).
  void set_activation_checkpoint(const ActivationCheckpoint& ac);
  const ActivationCheckpoint& activation_checkpoint() const { return ac_; }

  void init_weights(uint64_t seed);
  // Every parameter, shapes checked; a sharded model reads only its shards' slices.
  void load_hf(const SafetensorsDir& dir);
  void zero_grad();

  // A micro-batch: inputs/targets [B, T]; with context parallelism this cp rank's tokens
  // (T = seq_len / cp, at positions cp_positions). Gradients of (grad_scale * the summed loss)
  // accumulate into the units.
  ActivationStore micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              float grad_scale);
  // Forward of units [first, last) (units() order). x is the input of unit `first` (ignored for
  // the embedding, which reads the tokens); returns the output of unit last - 1 (empty when that
  // is the head: the head's fused projection + loss runs in its backward).
  Tensor forward(ActivationStore& s, size_t first, size_t last, Tensor x = {});
  // Backward of units [first, last), last first. dy is the gradient w.r.t. unit last - 1's output
  // (ignored when that is the head: the loss gives it); returns the gradient w.r.t. unit first's
  // input (empty for the embedding). The head's backward sets s.loss.
  Tensor backward(ActivationStore& s, size_t first, size_t last, Tensor dy = {});
  // Zero-bubble pipelines split a backward into the input gradient (I) and the weight gradient
  // (W). backward_input is backward() with every linear layer's weight gradient left in
  // `deferred` (its output gradient copied, its saved input kept; the norms', the embedding's and
  // the head's weight gradients come with I); weight_grads runs them later in the same order,
  // with no recomputation, giving each weight the bits of backward().
  using DeferredWeightGrads = std::vector<ops::DeferredWeightGrad>;
  Tensor backward_input(ActivationStore& s, size_t first, size_t last, Tensor dy,
                        DeferredWeightGrads& deferred);
  static void weight_grads(DeferredWeightGrads& deferred) { ops::run_weight_grads(deferred); }
  // The whole model on one micro-batch (pp = 1): forward over every unit, then backward. Returns
  // the sum of the per-token losses.
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale);

  // Bytes of activations one micro-batch holds at its peak (the analytic figure of the memory
  // model): without checkpointing every block's saved tensors; with it, the larger of what the
  // blocks save and, for the last block recomputed in backward, what the blocks before it save
  // plus that block's recomputed tensors. With tensor parallelism (tp ranks, sequence parallel,
  // recompute_allgather): one tp rank's. (model/llama_cost.cpp)
  static size_t saved_activation_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                       int tp = 1, bool sp = false, bool recompute = false,
                                       const ActivationCheckpoint& ac = {});
  // Bytes this rank sends on the tp group in one micro-batch (the analytic figure).
  uint64_t tp_bytes_per_micro_batch(int64_t B, int64_t T) const;
  // Bytes this rank sends on the cp group in one micro-batch of T tokens per sample on this rank
  // (ring attention's K/V, and dK/dV in backward; the analytic figure).
  uint64_t cp_bytes_per_micro_batch(int64_t B, int64_t T) const;
  // Ring attention's working set in a block's backward, the largest it holds (0 without cp).
  size_t ring_working_bytes(int64_t B, int64_t T) const;
  // Rows per chunk of the fused output projection + loss.
  static int64_t loss_chunk_rows(const LlamaConfig& c, int64_t B, int64_t T, DType compute);

 private:
  const RopeTable& rope_for(int64_t T);
  void hook(void (UnitHooks::*fn)(size_t), size_t unit);
  Tensor embedding_forward(ActivationStore& s);
  void embedding_backward(ActivationStore& s, const Tensor& dx);
  Tensor head_forward_backward(ActivationStore& s);  // returns the gradient w.r.t. its input
  size_t head_unit() const { return blocks_.size() + 1; }
  int64_t vocab_rows() const { return local_vocab(config_.vocab_size, tp().size()); }
  int64_t vocab_begin() const { return int64_t(tp().rank()) * vocab_rows(); }
  int64_t residual_rows(const StepContext& ctx) const;  // rows of the residual stream here
  size_t ring_kv_bytes(int64_t B, int64_t T) const;

  LlamaConfig config_;
  DType compute_;
  Device device_;
  ShardLayout shard_;
  dist::BufferPool pool_;
  std::unique_ptr<ParallelContext> par_;  // stable address: the blocks point at it
  UnitHooks* hooks_ = nullptr;
  ActivationCheckpoint ac_;
  std::unique_ptr<ParamUnit> embed_;
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;
  std::unique_ptr<ParamUnit> head_;
  RopeTable rope_;
};

}  // namespace loom
