#include "model/llama.hpp"

#include <string>
#include <utility>

#include "model/safetensors.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

}  // namespace

LlamaModel::LlamaModel(const LlamaConfig& config, DType compute, Device device, ShardLayout shard,
                       TpOptions tp, CpOptions cp)
    : config_(config), compute_(compute), device_(device), shard_(shard) {
  config_.validate("model config");
  LOOM_CHECK(compute == DType::f32 || compute == DType::bf16,
             "compute dtype must be float32 or bfloat16, got ", dtype_name(compute));
  const int n = tp.size(), r = tp.rank();
  if (n > 1) {
    // Refused rather than replicating kv heads (docs/design.md, "Tensor parallelism").
    for (auto [what, v] :
         {std::pair<const char*, int64_t>{"num_attention_heads", config_.num_attention_heads},
          {"num_key_value_heads", config_.num_key_value_heads},
          {"intermediate_size", config_.intermediate_size}})
      LOOM_CHECK(
          v % n == 0, "tensor parallelism: model ", what, " = ", v,
          " is not divisible by parallelism.tp = ", n, " (every tp rank holds ", what, " / tp",
          std::string(what) == "num_key_value_heads" ? "; kv heads are not replicated" : "", ")");
  } else {
    tp.group = nullptr;
  }
  par_ = std::make_unique<ParallelContext>();
  par_->tp.opt = tp;
  par_->tp.pool = &pool_;
  if (cp.size() <= 1) cp.group = nullptr;
  par_->cp = cp;
  const bool bf = compute == DType::bf16;
  // A vocabulary that tp does not divide is padded to the next multiple of tp (Megatron's
  // make-vocab-size-divisible-by): the padding rows are zero, their logits are masked out of the
  // loss, and checkpoints hold the real rows only (ParamSpec::global_rows).
  const int64_t d = config_.hidden_size, V = local_vocab(config_.vocab_size, n);
  const int64_t real_rows = V * n == config_.vocab_size ? 0 : config_.vocab_size;
  const ParamSpec emb{"model.embed_tokens.weight",
                      {V, d},
                      Init::normal,
                      0.02f,
                      true,
                      true,
                      TpSplit::rows,
                      r,
                      n,
                      real_rows};
  embed_ = std::make_unique<ParamUnit>("embed", std::vector<ParamSpec>{emb}, bf, device, shard);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    blocks_.push_back(
        std::make_unique<TransformerBlock>(config_, l, bf, device, shard, par_.get()));
  std::vector<ParamSpec> head{{"model.norm.weight", {d}, Init::ones, 0, false, true}};
  if (!config_.tie_word_embeddings)
    head.push_back({"lm_head.weight",
                    {V, d},
                    Init::normal,
                    0.02f,
                    true,
                    false,
                    TpSplit::rows,
                    r,
                    n,
                    real_rows});
  head_ = std::make_unique<ParamUnit>("head", head, bf, device, shard);
}

std::vector<ParamUnit*> LlamaModel::units() {
  std::vector<ParamUnit*> u{embed_.get()};
  for (auto& b : blocks_) u.push_back(&b->unit());
  u.push_back(head_.get());
  return u;
}

int64_t LlamaModel::num_params() const {
  int64_t n = embed_->numel() + head_->numel();
  for (auto& b : blocks_) n += b->unit().numel();
  return n;
}

void LlamaModel::init_weights(uint64_t seed) {
  for (ParamUnit* u : units()) u->init_weights(seed);
}

void LlamaModel::load_hf(const SafetensorsDir& dir) {
  for (ParamUnit* u : units()) {
    if (!u->sharded()) {
      for (auto& p : u->params()) {
        if (p.spec.split == TpSplit::none || p.spec.tp_count == 1)
          dir.read_f32(p.spec.name, p.spec.shape, p.value.data<float>());
        else
          read_param_slice(dir, p.spec.name, p.spec, 0, shape_numel(p.spec.shape),
                           p.value.data<float>());
      }
      u->refresh_bf16();
      continue;
    }
    float* shard = u->master_shard().data<float>();
    for (const ShardSlice& s : u->shard_slices()) {
      const ParamSpec& spec = u->params()[s.param].spec;
      read_param_slice(dir, spec.name, spec, s.begin, s.count, shard + s.shard_offset);
    }
  }
}

void LlamaModel::zero_grad() {
  for (ParamUnit* u : units()) u->zero_grad();
}

void LlamaModel::set_activation_checkpoint(const ActivationCheckpoint& ac) {
  LOOM_CHECK(ac.every_n >= 1, "activation checkpointing: every_n = ", ac.every_n,
             ", expected a positive integer");
  ac_ = ac;
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l]->set_checkpoint(ac.block_mode(int64_t(l)));
}

const RopeTable& LlamaModel::rope_for(int64_t T) {
  if (rope_.num_positions < T)
    rope_ = ops::rope_table(config_.head_dim(), T, config_.rope_theta, config_.rope_scaling);
  return rope_;
}

void LlamaModel::hook(void (UnitHooks::*fn)(size_t), size_t unit) {
  if (hooks_) (hooks_->*fn)(unit);
}

int64_t LlamaModel::residual_rows(const StepContext& ctx) const {
  const TpRuntime& tp = par_->tp;
  return tp.sp() ? ctx.tokens() / tp.opt.size() : ctx.tokens();
}

ActivationStore LlamaModel::micro_batch(const int32_t* inputs, const int32_t* targets, int64_t B,
                                        int64_t T, float grad_scale) {
  const TpRuntime& tp = par_->tp;
  const int tpn = tp.opt.size();
  const int64_t M = B * T;
  LOOM_CHECK(
      !tp.sp() || M % tpn == 0, "sequence parallelism: the micro-batch's B*T = ", B, "*", T, " = ",
      M, " rows are not divisible by parallelism.tp = ", tpn,
      " (each tp rank holds B*T / tp rows; or set parallelism.tp_sequence_parallel = false)");
  LOOM_CHECK(hooks_ || !shard_.sharded(),
             "forward_backward: a sharded model needs hooks that materialize its units");
  ActivationStore s;
  s.inputs = inputs;
  s.targets = targets;
  s.grad_scale = grad_scale;
  s.ctx.B = B;
  s.ctx.T = T;
  s.ctx.compute = compute_;
  const int64_t span =
      cp_micro_batch_positions(par_->cp, T, tp.sp() ? tpn : 1, s.ctx.positions, s.ctx.cp_pos);
  s.ctx.rope = &rope_for(span);
  s.blocks.resize(blocks_.size());
  return s;
}

Tensor LlamaModel::forward(ActivationStore& s, size_t first, size_t last, Tensor x) {
  LOOM_CHECK(first <= last && last <= num_units(), "forward: units [", first, ", ", last, ") of ",
             num_units());
  for (size_t u = first; u < last; ++u) {
    hook(&UnitHooks::before_forward, u);
    if (u == 0) {
      x = embedding_forward(s);
    } else if (u == head_unit()) {
      // The head's projection and loss run fused with its backward: keep its input.
      s.head_input = std::exchange(x, Tensor());
    } else {
      x = blocks_[u - 1]->forward(s.ctx, x, s.blocks[u - 1]);
    }
    hook(&UnitHooks::after_forward, u);
  }
  return x;
}

Tensor LlamaModel::backward(ActivationStore& s, size_t first, size_t last, Tensor dy) {
  LOOM_CHECK(first <= last && last <= num_units(), "backward: units [", first, ", ", last, ") of ",
             num_units());
  for (size_t u = last; u-- > first;) {
    hook(&UnitHooks::before_backward, u);
    if (u == head_unit()) {
      dy = head_forward_backward(s);
    } else if (u == 0) {
      embedding_backward(s, dy);
    } else {
      blocks_[u - 1]->backward(s.ctx, dy, s.blocks[u - 1]);
    }
    hook(&UnitHooks::after_backward, u);
    if (u == head_unit()) s.head_input = Tensor();
    if (u == 0) dy = Tensor();
  }
  return dy;
}

Tensor LlamaModel::backward_input(ActivationStore& s, size_t first, size_t last, Tensor dy,
                                  DeferredWeightGrads& deferred) {
  // Under tp the inputs may be gathered into pooled buffers that the next layer reuses (without
  // the copies pp2 x tp2 zb1p ended 1.7e-2 off one process in its final weights).
  const ops::DeferWeightGrads defer(deferred, tp().size() > 1);
  return backward(s, first, last, std::move(dy));
}

double LlamaModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                    int64_t T, float grad_scale) {
  ActivationStore s = micro_batch(inputs, targets, B, T, grad_scale);
  backward(s, 0, num_units(), forward(s, 0, num_units()));
  return s.loss;
}

Tensor LlamaModel::embedding_forward(ActivationStore& s) {
  Tensor x = f32({residual_rows(s.ctx), config_.hidden_size}, device_);
  vocab_parallel_embedding_forward(par_->tp, s.inputs, s.ctx.tokens(), embed_->params()[0].value,
                                   vocab_begin(), x);
  return x;
}

void LlamaModel::embedding_backward(ActivationStore& s, const Tensor& dx) {
  vocab_parallel_embedding_backward(par_->tp, s.inputs, s.ctx.tokens(), dx, vocab_begin(),
                                    embed_->params()[0].grad);
}

// The final norm, then the output projection fused with the loss, forward and backward.
Tensor LlamaModel::head_forward_backward(ActivationStore& s) {
  const TpRuntime& tp = par_->tp;
  const int64_t M = s.ctx.tokens(), Mx = residual_rows(s.ctx), d = config_.hidden_size;
  const Tensor& x = s.head_input;
  Param& norm = head_->params()[0];
  Tensor rstd = f32({Mx}, device_), xf = f32({Mx, d}, device_);
  ops::rmsnorm_forward(x, norm.value, float(config_.rms_norm_eps), xf, rstd);
  Tensor dxf;
  {
    ops::LinearCrossEntropy ce;
    ce.x = ops::to_compute(xf, compute_);
    xf = Tensor();
    if (tp.sp()) ce.x = tp_gather_input(tp, ce.x);
    dxf = tp.on() ? tp_pooled(tp, "col_dx", {M, d}, DType::f32, device_) : f32({M, d}, device_);
    ParamUnit& out_unit = config_.tie_word_embeddings ? *embed_ : *head_;
    const size_t out_index = config_.tie_word_embeddings ? 0 : 1;
    ce.w = out_unit.gemm_weight(out_index);
    ce.dx = dxf;
    ce.dw = out_unit.params()[out_index].grad;
    ce.targets = s.targets;
    ce.V = vocab_rows();
    ce.grad_scale = s.grad_scale;
    ce.chunk_rows = loss_chunk_rows(config_, s.ctx.B, s.ctx.T, compute_);
    s.loss = vocab_parallel_cross_entropy(tp, ce, vocab_begin(), config_.vocab_size);
  }
  if (tp.on()) dxf = tp_sum_partial(tp, dxf);
  Tensor dx = Tensor::zeros({Mx, d}, DType::f32, device_);
  tp_summed_norm_grad(tp, norm.grad,
                      [&](Tensor& g) { ops::rmsnorm_backward(dxf, x, norm.value, rstd, dx, g); });
  return dx;
}

}  // namespace loom
