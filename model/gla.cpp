#include "model/gla.hpp"

#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.hpp"
#include "model/safetensors.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

}  // namespace

GlaModel::GlaModel(const GlaConfig& config, DType compute, Device device, TpOptions tp,
                   CpOptions cp)
    : config_(config), compute_(compute), device_(device) {
  config_.validate("model config");
  LOOM_CHECK(compute == DType::f32 || compute == DType::bf16,
             "compute dtype must be float32 or bfloat16, got ", dtype_name(compute));
  if (tp.size() <= 1) tp.group = nullptr;
  par_ = std::make_unique<ParallelContext>();
  par_->tp.opt = tp;
  par_->tp.pool = &pool_;
  if (cp.size() <= 1) cp.group = nullptr;
  par_->cp = cp;
  const bool bf = compute == DType::bf16;
  const int64_t d = config_.hidden_size, V = config_.vocab_size;
  const float s = float(config_.initializer_range);
  embed_ = std::make_unique<ParamUnit>(
      "embed",
      std::vector<ParamSpec>{{"model.embeddings.weight", {V, d}, Init::normal, s, true, true}}, bf,
      device);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    blocks_.push_back(std::make_unique<GlaBlock>(config_, l, bf, device, par_.get()));
  std::vector<ParamSpec> head{{"model.norm.weight", {d}, Init::ones, 0, false, true}};
  if (!config_.tie_word_embeddings) head.push_back({"lm_head.weight", {V, d}, Init::normal, s});
  head_ = std::make_unique<ParamUnit>("head", head, bf, device);
}

std::vector<ParamUnit*> GlaModel::units() {
  std::vector<ParamUnit*> u{embed_.get()};
  for (auto& b : blocks_) u.push_back(&b->unit());
  u.push_back(head_.get());
  return u;
}

int64_t GlaModel::num_params() const {
  int64_t n = embed_->numel() + head_->numel();
  for (auto& b : blocks_) n += b->unit().numel();
  return n;
}

void GlaModel::init_weights(uint64_t seed) {
  for (ParamUnit* u : units()) u->init_weights(seed);
}

void GlaModel::load_hf(const SafetensorsDir& dir) {
  std::set<std::string> expected;
  for (ParamUnit* u : units()) {
    for (auto& p : u->params()) {
      expected.insert(p.spec.name);
      if (p.spec.split == TpSplit::none || p.spec.tp_count == 1)
        dir.read_f32(p.spec.name, p.spec.shape, p.value.data<float>());
      else
        read_param_slice(dir, p.spec.name, p.spec, 0, shape_numel(p.spec.shape),
                         p.value.data<float>());
    }
    u->refresh_bf16();
  }
  for (const std::string& n : dir.names())
    LOOM_CHECK(expected.count(n), "GLA checkpoint: tensor '", n,
               "' is not a parameter of this model (config.json describes another variant: "
               "use_output_gate, use_short_conv, elementwise_affine, tie_word_embeddings?)");
}

void GlaModel::save_hf(const std::string& dir) {
  LOOM_CHECK(tp_size() == 1, "GLA save_hf: one process only (tp = ", tp_size(), ")");
  std::filesystem::create_directories(dir);
  std::vector<NamedTensor> w;
  for (ParamUnit* u : units())
    for (auto& p : u->params()) w.push_back({p.spec.name, p.value});
  write_safetensors_dir(dir, w);
  std::ofstream f(std::filesystem::path(dir) / "config.json");
  f << config_.to_json();
  LOOM_CHECK(f.good(), "GLA save_hf: cannot write ", dir, "/config.json");
}

void GlaModel::set_activation_checkpoint(const ActivationCheckpoint& ac) {
  LOOM_CHECK(ac.every_n >= 1, "activation checkpointing: every_n = ", ac.every_n,
             ", expected a positive integer");
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l]->set_checkpoint(ac.block_mode(int64_t(l)));
}

void GlaModel::zero_grad() {
  for (ParamUnit* u : units()) u->zero_grad();
}

double GlaModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                  int64_t T, float grad_scale) {
  const TpRuntime& tp = par_->tp;
  const int tpn = tp.opt.size();
  const int64_t M = B * T, d = config_.hidden_size;
  LOOM_CHECK(!tp.sp() || M % tpn == 0, "sequence parallelism: the micro-batch's B*T = ", M,
             " rows are not divisible by parallelism.tp = ", tpn);
  // With SP the residual stream holds this rank's rows [own * Mx, own * Mx + Mx).
  const int64_t Mx = tp.sp() ? M / tpn : M, own = tp.opt.rank();
  StepContext ctx;
  ctx.B = B;
  ctx.T = T;
  ctx.compute = compute_;
  cp_micro_batch_positions(par_->cp, T, tp.sp() ? tpn : 1, ctx.positions, ctx.cp_pos);
  Tensor x = f32({M, d}, device_);
  ops::embedding_forward(inputs, embed_->params()[0].value, x);
  if (tp.sp()) {
    Tensor mine = f32({Mx, d}, device_);
    ops::copy_rows(x.narrow(0, own * Mx, Mx), mine);
    x = mine;
  }
  std::vector<GlaBlockActs> acts(blocks_.size());
  for (size_t l = 0; l < blocks_.size(); ++l) x = blocks_[l]->forward(ctx, x, acts[l]);
  saved_bytes_ = 0;
  for (const GlaBlockActs& a : acts) saved_bytes_ += a.bytes();

  // The final norm, then the output projection fused with the loss over every row (the head is
  // replicated over tp: each rank computes the same loss and head gradients).
  Param& norm = head_->params()[0];
  const float eps = float(config_.norm_eps);
  Tensor rstd = f32({Mx}, device_), xf = f32({Mx, d}, device_), dxf = f32({M, d}, device_);
  ops::rmsnorm_forward(x, norm.value, eps, xf, rstd);
  ParamUnit& out_unit = config_.tie_word_embeddings ? *embed_ : *head_;
  const size_t out_index = config_.tie_word_embeddings ? 0 : 1;
  ops::LinearCrossEntropy ce;
  ce.x = ops::to_compute(xf, compute_);
  if (tp.sp()) ce.x = tp_gather_input(tp, ce.x);
  ce.w = out_unit.gemm_weight(out_index);
  ce.dx = dxf;
  ce.dw = out_unit.params()[out_index].grad;
  ce.targets = targets;
  ce.V = config_.vocab_size;
  ce.grad_scale = grad_scale;
  const double loss = ops::linear_cross_entropy(ce);
  Tensor dy = Tensor::zeros({Mx, d}, DType::f32, device_);
  const Tensor dxf_mine = tp.sp() ? dxf.narrow(0, own * Mx, Mx) : dxf;
  tp_summed_norm_grad(tp, norm.grad, [&](Tensor& g) {
    ops::rmsnorm_backward(dxf_mine, x, norm.value, rstd, dy, g);
  });

  for (size_t l = blocks_.size(); l-- > 0;) blocks_[l]->backward(ctx, dy, acts[l]);
  // Every rank adds every row's gradient to its (replicated) table.
  ops::embedding_backward(inputs, tp.sp() ? tp_gather_input(tp, dy) : dy, embed_->params()[0].grad);
  return loss;
}

}  // namespace loom
