#pragma once
// The mixture-of-experts model (Qwen3-MoE, Mixtral: model/moe_config.hpp), a Model
// (model/model.hpp): an embedding unit, per layer an attention block and, in a sparse layer, an
// experts block (model/moe_block.hpp: two units, so that the experts can be sharded apart), and
// the shared head (model/head.hpp). Each micro-batch's router statistics ride in its
// ActivationStore; the head adds transformers' auxiliary load-balancing loss (router_aux_loss_coef
// x it, where output_router_logits asks) and sets its gradient before any block's backward
// (docs/decisions/moe.md).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/head.hpp"
#include "model/model.hpp"
#include "model/moe_balance.hpp"
#include "model/moe_block.hpp"
#include "model/moe_config.hpp"
#include "model/moe_plan.hpp"

namespace loom {

class MoeModel final : public Model {
 public:
  // `ep`: expert parallelism (each ep rank builds and runs E / ep of the experts).
  MoeModel(const MoeConfig& config, DType compute, Device device = Device::cpu,
           ShardLayout shard = {}, TpOptions tp = {}, CpOptions cp = {},
           std::vector<bool> used = {}, EpOptions ep = {});

  const MoeConfig& config() const { return config_; }
  // Layer l's attention block, and its experts block (null in a dense layer): the inference path
  // runs their branches (model/moe_inference.hpp).
  MoeAttentionBlock& attention_block(int64_t l) { return *attention_[size_t(l)]; }
  MoeExpertsBlock* experts_block(int64_t l) { return experts_[size_t(l)].get(); }

  const char* model_type() const override { return config_.model_type(); }
  std::string config_json() const override { return config_.to_json(); }
  int64_t vocab_size() const override { return config_.base.vocab_size; }
  int64_t hidden_size() const override { return config_.base.hidden_size; }
  bool tie_word_embeddings() const override { return config_.base.tie_word_embeddings; }
  std::span<const PlanEntry> tp_plan() const override { return moe_plan(); }
  std::string describe() const override;
  double flops_per_token(int64_t T) const override { return config_.flops_per_token(T); }

  // The micro-batch's router statistics (after its forward) and its auxiliary loss (the unscaled
  // load-balancing loss, after the head's backward; 0 without sparse layers).
  static const RouterStats& router_stats(const ActivationStore& s);
  static double aux_loss(const ActivationStore& s);
  // aux_loss: the auxiliary loss's mean over the micro-batches; expert_load: the most choices any
  // expert got over the mean (before a capacity drops any), in the worst sparse layer of any
  // micro-batch (1: balanced);
  // dropped: the share of the choices over an expert's capacity.
  std::vector<ModelMetric> take_step_metrics() override;
  // The auxiliary-loss-free bias and the runaway-router warning (model/moe_balance.hpp).
  std::vector<std::string> after_update(dist::ProcessGroup* dp, dist::ProcessGroup* pp) override;
  const ExpertBalance& balance() const { return balance_; }
  bool expert_unit(size_t unit) const override;
  // A directory without the selection-only biases (a Hugging Face Qwen-MoE or Mixtral) starts
  // them at zero.
  void load_hf(const SafetensorsDir& dir) override;
  std::vector<std::string> held_elsewhere() const override;
  // Pipeline parallelism: the router statistics travel forward to the head, the auxiliary loss's
  // gradient per expert back to every stage (model/model.hpp).
  Tensor carry_buffer(bool backward) const override;
  Tensor carry_out(const ActivationStore& s, bool backward) const override;
  void carry_in(ActivationStore& s, bool backward, const Tensor& carry) override;

 private:
  const ops::Rope& rope_for(int64_t T);
  int64_t vocab_first() const {
    return vocab_begin(config_.base.vocab_size, par().tp.opt.rank(), par().tp.opt.size());
  }
  void prepare(ActivationStore& s, int64_t span) override;
  void set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) override;
  Tensor embedding_forward(ActivationStore& s) override;
  void embedding_backward(ActivationStore& s, const Tensor& dx) override;
  Tensor block_forward(ActivationStore& s, size_t block, const Tensor& x) override;
  void block_backward(ActivationStore& s, size_t block, Tensor& dy) override;
  Tensor head_forward_backward(ActivationStore& s) override;
  // The auxiliary loss of the micro-batch's statistics, its scaled share added to s.loss.extra and
  // its gradient per expert probability set.
  void add_aux_loss(ActivationStore& s);
  // Whether training adds the auxiliary loss (transformers' output_router_logits and a
  // coefficient).
  bool trains_aux() const {
    return config_.output_router_logits && config_.router_aux_loss_coef > 0;
  }

  // The model's blocks in order: layer l's attention block, then its experts block if sparse.
  struct SubBlock {
    int64_t layer;
    bool experts;
  };
  MoeConfig config_;
  std::vector<SubBlock> order_;
  std::vector<std::unique_ptr<MoeAttentionBlock>> attention_;  // per layer
  std::vector<std::unique_ptr<MoeExpertsBlock>> experts_;      // per layer (null: dense)
  struct StepSums {
    double aux = 0, load = 0, dropped = 0, choices = 0;
    int64_t micro_batches = 0;
  } step_;
  ExpertBalance balance_;
  ops::Rope rope_;
};

}  // namespace loom
