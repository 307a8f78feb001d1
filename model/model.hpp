#pragma once
// The model interface the trainer, the parallel wrappers (FSDP, DDP, the pipeline executor) and
// the commands work through (docs/design.md decision 1): a model is a sequence of parameter units,
// an embedding unit, one unit per block and a head unit, run per micro-batch over any range of
// units with the micro-batch's activations in an ActivationStore that lives between the calls.
// LlamaModel (model/llama.hpp) and GlaModel (model/gla.hpp) implement it.
//
// The unit plumbing every model shares is here, once: the parallel context the blocks point at,
// the hooks called around each unit, the range loops of forward and backward (the head's forward
// and backward are one fused computation), zeroing, initialization and activation
// checkpointing. A model supplies its units' computations. What a step holds and sends is measured
// by running it on the meta device (train/rank_plan.hpp), not declared by the model.
#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/buffer_pool.hpp"
#include "model/loss_slots.hpp"
#include "model/param_unit.hpp"
#include "model/step_context.hpp"
#include "model/tp_plan.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/activation_checkpoint.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

class SafetensorsDir;

// Called by the model around the work of each unit, unit i in units() order (embedding, blocks,
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
// flight. Made by Model::micro_batch, which copies the tokens to the run's device.
struct ActivationStore {
  StepContext ctx;
  Tensor inputs;   // int32 [B*T] on the run's device
  Tensor targets;  // int32 [B*T] on the run's device
  float grad_scale = 1;
  // Block l's saved activations (unit l + 1), of the model's own type (Llama: LlamaBlockActs, GLA:
  // GlaBlockActs).
  std::vector<std::any> blocks;
  // The model's state of the micro-batch beside its blocks' (MoE: the router's statistics and the
  // auxiliary loss, model/moe.hpp).
  std::any extra;
  Tensor head_input;  // the last block's output, kept for the head's fused pass
  // The summed loss, once the head's backward ran: the head writes it into the model's slot
  // loss.slot on the run's device (Model::loss_slots) and a model may add a part on the host
  // (loss.extra: MoE's auxiliary loss); Model::loss reads one, the step's callers all at once.
  PendingLoss loss;
};

// A number a model measured over a step's micro-batches beside the loss (MoE: its auxiliary
// loss, the experts' load): metrics.jsonl's `name`, the progress line's `label`.
struct ModelMetric {
  std::string name, label;
  double value = 0;
};

class Model {
 public:
  virtual ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // --- What the model is (its config.json) ---
  virtual const char* model_type() const = 0;   // config.json's model_type: "llama", "gla"
  virtual std::string config_json() const = 0;  // the Hugging Face config.json it was built from
  virtual int64_t vocab_size() const = 0;
  virtual int64_t hidden_size() const = 0;
  virtual bool tie_word_embeddings() const = 0;
  // Its tensor-parallel plan (model/tp_plan.hpp): how tensor parallelism splits each parameter,
  // by name. The model builds its local shards by it; parallelize() checks the built model.
  virtual std::span<const PlanEntry> tp_plan() const = 0;
  // One line for the trainer's log: the shape ("dim 64, 2 layers, ...").
  virtual std::string describe() const = 0;
  // Training FLOPs per token at sequence length T (the MFU convention of the model's family).
  virtual double flops_per_token(int64_t T) const = 0;
  // What this rank's micro-batches measured since the last call (each one's head adds to it), then
  // forgotten. Empty for the families that measure nothing beside the loss. The step averages
  // them over dp and sums them over pp: a pipeline rank without the head returns the same names
  // with zeros (what its stages measured travels to the head: the carry below).
  virtual std::vector<ModelMetric> take_step_metrics() { return {}; }
  // After the step's optimizer update, on every rank of the step (it may run collectives, on meta
  // too): the model's own state that follows from what the window take_step_metrics closed
  // measured (MoE: the auxiliary-loss-free bias), and lines for the log. `dp`: the data-parallel
  // group the step's micro-batches are spread over (with the model's cp group); `pp`: the
  // pipeline's (what a micro-batch measured is on its head's rank).
  virtual std::vector<std::string> after_update(dist::ProcessGroup* dp, dist::ProcessGroup* pp) {
    (void)dp, (void)pp;
    return {};
  }

  // --- A few numbers of a micro-batch that travel between pipeline stages ---
  // For a model whose head needs what every stage's blocks measured, or whose blocks' backward
  // needs what the head computed (MoE: the router statistics forward, the auxiliary loss's
  // gradient per expert backward). The pipeline sends the carry as a second message beside each
  // activation (forward) or gradient (backward) that crosses ranks; between two stages of one
  // rank the micro-batch's store is the same and nothing moves. Its size is the config's, never
  // the data's, so that a meta run sends the same messages. Undefined: nothing travels (Llama,
  // GLA: no extra message).
  // A buffer of the carry's shape on device() to receive into (its values unset).
  virtual Tensor carry_buffer(bool backward) const {
    (void)backward;
    return {};
  }
  // The carry of micro-batch `s` after this rank's stage ran its forward (backward).
  virtual Tensor carry_out(const ActivationStore& s, bool backward) const {
    (void)s, (void)backward;
    return {};
  }
  // The carry received from the previous stage's rank (forward) or the next one's (backward):
  // replaces what `s` held, before this rank's stage runs.
  virtual void carry_in(ActivationStore& s, bool backward, const Tensor& carry) {
    (void)s, (void)backward, (void)carry;
  }
  // Whether unit i (units() order) holds experts that expert parallelism splits over the ep ranks:
  // sharded over the ranks that hold the same experts (ParallelContext::ep), not all of FSDP's.
  virtual bool expert_unit(size_t unit) const {
    (void)unit;
    return false;
  }
  // The model's parameters that other ranks hold and this one does not (expert parallelism: the
  // other ep ranks' experts), by global name: a checkpoint holds them too.
  virtual std::vector<std::string> held_elsewhere() const { return {}; }

  DType compute_dtype() const { return compute_; }
  Device device() const { return device_; }
  std::vector<ParamUnit*> units();
  size_t num_units() const { return blocks_.size() + 2; }
  // Whether this rank runs unit i (units() order): false for a pp rank's units of other stages,
  // which hold no memory (built on Device::elsewhere).
  bool uses(size_t unit) const { return used_.empty() || (unit < used_.size() && used_[unit]); }
  size_t num_blocks() const { return blocks_.size(); }
  int64_t num_params() const;  // this rank's (its tp slices, unsharded)

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
  // Every parameter, shapes checked; a sharded model reads only its shards' slices
  // (load_units; a model may check more, e.g. that `dir` holds no tensor it does not have).
  virtual void load_hf(const SafetensorsDir& dir) { load_units(dir); }
  void zero_grad();
  // ParamUnit::check_grads_written on every unit this rank uses.
  void check_grads_written();

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
  // input (empty for the embedding). The head's backward writes s.loss (its slot).
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
  // The same, its loss left on the device (read it with loss_slots().read, with others).
  PendingLoss forward_backward_pending(const int32_t* inputs, const int32_t* targets, int64_t B,
                                       int64_t T, float grad_scale);
  // The micro-batches' loss slots (model/loss_slots.hpp), and one store's loss read now.
  LossSlots& loss_slots() { return loss_slots_; }
  double loss(const ActivationStore& s) const { return loss_slots_.read(s.loss); }

 protected:
  // Tensor and context parallelism as given (groups of one rank dropped): par() is ready for the
  // blocks the derived constructor makes.
  // `used` (empty: every unit): per unit (units() order), whether this rank runs it; the others
  // are built on Device::elsewhere (a pipeline rank's units of other stages: names and shapes for
  // bookkeeping, no memory), and init, zeroing, the optimizer and the norm skip them.
  Model(DType compute, Device device, ShardLayout shard, TpOptions tp, CpOptions cp,
        std::vector<bool> used = {}, EpOptions ep = {});
  // Where unit i (units() order) lives: device(), or Device::elsewhere where this rank does not
  // use it.
  Device unit_device(size_t unit) const { return uses(unit) ? device_ : Device::elsewhere; }
  // The derived constructor's units, in order. The model keeps them; block_unit(l) is block l's.
  void set_units(std::unique_ptr<ParamUnit> embed, std::vector<ParamUnit*> blocks,
                 std::unique_ptr<ParamUnit> head);

  const ParallelContext& par() const { return *par_; }
  ParamUnit& embed_unit() { return *embed_; }
  const ParamUnit& embed_unit() const { return *embed_; }
  ParamUnit& head_unit() { return *head_; }
  const ParamUnit& head_unit() const { return *head_; }
  size_t head_index() const { return blocks_.size() + 1; }
  // Every parameter of every unit from `dir` (global names): whole or this tp rank's slice into
  // unsharded units (then their bf16 mirrors), this rank's shard into sharded ones. A parameter
  // `dir` lacks reads as zeros where zero_if_absent(its name) says it may (else an error).
  void load_units(const SafetensorsDir& dir,
                  const std::function<bool(const std::string&)>& zero_if_absent = {});
  // Rows of the residual stream on this rank (B*T / tp with sequence parallelism).
  int64_t residual_rows(const StepContext& ctx) const;

  // The units' computations, called between the hooks.
  virtual void prepare(ActivationStore& s, int64_t span) = 0;  // span: positions the step covers
  virtual void set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) = 0;
  virtual Tensor embedding_forward(ActivationStore& s) = 0;
  virtual void embedding_backward(ActivationStore& s, const Tensor& dx) = 0;
  virtual Tensor block_forward(ActivationStore& s, size_t block, const Tensor& x) = 0;
  virtual void block_backward(ActivationStore& s, size_t block, Tensor& dy) = 0;
  // The head's forward fused with its backward: writes s.loss's slot, returns the gradient w.r.t.
  // its input (s.head_input).
  virtual Tensor head_forward_backward(ActivationStore& s) = 0;

  DType compute_;
  Device device_;
  LossSlots loss_slots_{device_};
  ShardLayout shard_;
  dist::BufferPool pool_;

 private:
  void hook(void (UnitHooks::*fn)(size_t), size_t unit);

  std::unique_ptr<ParallelContext> par_;  // stable address: the blocks point at it
  UnitHooks* hooks_ = nullptr;
  std::vector<bool> used_;
  ActivationCheckpoint ac_;
  std::unique_ptr<ParamUnit> embed_;
  std::vector<ParamUnit*> blocks_;  // owned by the derived model's blocks
  std::unique_ptr<ParamUnit> head_;
};

}  // namespace loom
