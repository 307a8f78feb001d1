#include "model/gla.hpp"

#include <any>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.hpp"
#include "model/head.hpp"
#include "model/safetensors.hpp"
#include "ops/ops.hpp"

namespace loom {

GlaModel::GlaModel(const GlaConfig& config, DType compute, Device device, ShardLayout shard,
                   TpOptions tp, CpOptions cp, std::vector<bool> used)
    : Model(compute, device, shard, tp, cp, std::move(used)), config_(config) {
  config_.validate("model config");
  const bool bf = compute == DType::bf16;
  const int64_t d = config_.hidden_size, V = config_.vocab_size;
  const float s = float(config_.initializer_range);
  // The embedding and the head are replicated by GLA's plan (no vocabulary parallelism); their
  // splits are looked up all the same, so that the plan stays the source of every split.
  auto planned = [](std::vector<ParamSpec> specs) {
    for (ParamSpec& sp : specs) sp.split = split_of(gla_plan(), sp.name);
    return specs;
  };
  auto embed = std::make_unique<ParamUnit>(
      "embed", planned({{"model.embeddings.weight", {V, d}, Init::normal, s, true, true}}), bf,
      unit_device(0), shard);
  std::vector<ParamUnit*> block_units;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    blocks_.push_back(
        std::make_unique<GlaBlock>(config_, l, bf, unit_device(size_t(l) + 1), &par(), shard));
    block_units.push_back(&blocks_.back()->unit());
  }
  std::vector<ParamSpec> head{{"model.norm.weight", {d}, Init::ones, 0, false, true}};
  if (!config_.tie_word_embeddings) {
    head.push_back({"lm_head.weight", {V, d}, Init::normal, s});
    head.back().gemm_grad = true;  // only the loss's dW GEMMs write it (ParamUnit::zero_grad)
  }
  set_units(std::move(embed), std::move(block_units),
            std::make_unique<ParamUnit>("head", planned(std::move(head)), bf,
                                        unit_device(size_t(config_.num_hidden_layers) + 1), shard));
}

std::string GlaModel::describe() const {
  return str_cat("GLA, dim ", config_.hidden_size, ", ", config_.num_hidden_layers, " layers, ",
                 config_.num_heads, "/", config_.num_kv_heads, " heads, key dim ",
                 config_.key_dim(), ", value dim ", config_.value_dim(), ", ffn ",
                 config_.intermediate_size, ", vocab ", config_.vocab_size);
}

void GlaModel::load_hf(const SafetensorsDir& dir) {
  load_units(dir);
  std::set<std::string> expected;
  for (ParamUnit* u : units())
    for (auto& p : u->params()) expected.insert(p.spec.name);
  for (const std::string& n : dir.names()) {
    // A loom checkpoint also holds each parameter's AdamW moments.
    const bool moment = dir.sharded() && (n.ends_with(".exp_avg") || n.ends_with(".exp_avg_sq"));
    LOOM_CHECK(expected.count(n) || moment, "GLA checkpoint: tensor '", n,
               "' is not a parameter of this model (config.json describes another variant: "
               "use_output_gate, use_short_conv, elementwise_affine, tie_word_embeddings?)");
  }
}

void GlaModel::save_hf(const std::string& dir) {
  LOOM_CHECK(tp_size() == 1 && !shard_layout().sharded(),
             "GLA save_hf: one process only (tp = ", tp_size(), ", shards ", shard_layout().count,
             ")");
  std::filesystem::create_directories(dir);
  std::vector<NamedTensor> w;
  for (ParamUnit* u : units())
    for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
  write_safetensors_dir(dir, w);
  std::ofstream f(std::filesystem::path(dir) / "config.json");
  f << config_.to_json();
  LOOM_CHECK(f.good(), "GLA save_hf: cannot write ", dir, "/config.json");
}

void GlaModel::prepare(ActivationStore&, int64_t) {}

void GlaModel::set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) {
  blocks_[block]->set_checkpoint(mode);
}

// With SP the residual stream holds this rank's rows [rank * Mx, rank * Mx + Mx); the table is
// replicated, so every rank looks up every row and keeps its own.
Tensor GlaModel::embedding_forward(ActivationStore& s) {
  const TpRuntime& tp = par().tp;
  const int64_t M = s.ctx.tokens(), Mx = residual_rows(s.ctx), d = config_.hidden_size;
  Tensor x = f32({M, d}, device_);
  ops::embedding_forward(s.inputs, embed_unit().params()[0].value, x);
  if (!tp.sp()) return x;
  Tensor mine = f32({Mx, d}, device_);
  ops::copy_rows(x.narrow(0, int64_t(tp.opt.rank()) * Mx, Mx), mine);
  return mine;
}

// Every rank adds every row's gradient to its (replicated) table.
void GlaModel::embedding_backward(ActivationStore& s, const Tensor& dx) {
  const TpRuntime& tp = par().tp;
  ops::embedding_backward(s.inputs, tp.sp() ? tp_gather_input(tp, dx) : dx,
                          embed_unit().params()[0].grad);
}

Tensor GlaModel::block_forward(ActivationStore& s, size_t block, const Tensor& x) {
  if (!s.blocks[block].has_value()) s.blocks[block] = GlaBlockActs();
  return blocks_[block]->forward(s.ctx, x, std::any_cast<GlaBlockActs&>(s.blocks[block]));
}

void GlaModel::block_backward(ActivationStore& s, size_t block, Tensor& dy) {
  blocks_[block]->backward(s.ctx, dy, std::any_cast<GlaBlockActs&>(s.blocks[block]));
}

// The final norm, then the output projection fused with the loss over every row (model/head.hpp):
// replicated over tp, as gla_plan() says (each rank computes the same loss and head gradients).
Tensor GlaModel::head_forward_backward(ActivationStore& s) {
  saved_bytes_ = 0;
  for (const std::any& a : s.blocks)
    if (const auto* acts = std::any_cast<GlaBlockActs>(&a)) saved_bytes_ += acts->bytes();
  const LossHead head{.tp = par().tp,
                      .plan = gla_plan(),
                      .precision = GlaBlock::kPrecision,
                      .tied = config_.tie_word_embeddings,
                      .M = s.ctx.tokens(),
                      .Mx = residual_rows(s.ctx),
                      .d = config_.hidden_size,
                      .vocab = config_.vocab_size,
                      .eps = float(config_.norm_eps),
                      .compute = compute_};
  return head.forward_backward(head_unit(), embed_unit(), s.head_input, s.targets, s.grad_scale,
                               loss_slots_.slot(s.loss.slot));
}

}  // namespace loom
