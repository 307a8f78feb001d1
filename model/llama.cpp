#include "model/llama.hpp"

#include <any>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "ops/ops.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

}  // namespace

LlamaModel::LlamaModel(const LlamaConfig& config, DType compute, Device device, ShardLayout shard,
                       TpOptions tp, CpOptions cp, std::vector<bool> used)
    : Model(compute, device, shard, tp, cp, std::move(used)), config_(config) {
  config_.validate("model config");
  const int n = tp.size(), r = tp.rank();
  if (n > 1) {
    // Refused rather than replicating kv heads (docs/decisions/tensor-parallel.md).
    for (auto [what, v] :
         {std::pair<const char*, int64_t>{"num_attention_heads", config_.num_attention_heads},
          {"num_key_value_heads", config_.num_key_value_heads},
          {"intermediate_size", config_.intermediate_size}})
      LOOM_CHECK(
          v % n == 0, "tensor parallelism: model ", what, " = ", v,
          " is not divisible by parallelism.tp = ", n, " (every tp rank holds ", what, " / tp",
          std::string(what) == "num_key_value_heads" ? "; kv heads are not replicated" : "", ")");
  }
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
                      split_of(llama_plan(), "model.embed_tokens.weight"),
                      r,
                      n,
                      real_rows};
  auto embed =
      std::make_unique<ParamUnit>("embed", std::vector<ParamSpec>{emb}, bf, unit_device(0), shard);
  std::vector<ParamUnit*> block_units;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    blocks_.push_back(
        std::make_unique<LlamaBlock>(config_, l, bf, unit_device(size_t(l) + 1), shard, &par()));
    block_units.push_back(&blocks_.back()->unit());
  }
  std::vector<ParamSpec> head{{"model.norm.weight", {d}, Init::ones, 0, false, true}};
  if (!config_.tie_word_embeddings)
    head.push_back({"lm_head.weight",
                    {V, d},
                    Init::normal,
                    0.02f,
                    true,
                    false,
                    split_of(llama_plan(), "lm_head.weight"),
                    r,
                    n,
                    real_rows});
  // Only the loss's dW GEMMs write the output head's gradient (ParamUnit::zero_grad).
  if (!config_.tie_word_embeddings) head.back().gemm_grad = true;
  set_units(std::move(embed), std::move(block_units),
            std::make_unique<ParamUnit>("head", head, bf,
                                        unit_device(size_t(config_.num_hidden_layers) + 1), shard));
}

std::string LlamaModel::describe() const {
  return str_cat("dim ", config_.hidden_size, ", ", config_.num_hidden_layers, " layers, ",
                 config_.num_attention_heads, "/", config_.num_key_value_heads, " heads, ffn ",
                 config_.intermediate_size, ", vocab ", config_.vocab_size);
}

const RopeTable& LlamaModel::rope_for(int64_t T) {
  if (rope_.num_positions >= T) return rope_;
  if (!ops::computes(device_)) {
    // No kernel reads it there (meta): its size only (the planner builds thousands of models).
    rope_.head_dim = config_.head_dim();
    rope_.num_positions = T;
  } else {
    rope_ = ops::rope_table(config_.head_dim(), T, config_.rope_theta, config_.rope_scaling);
  }
  return rope_;
}

void LlamaModel::prepare(ActivationStore& s, int64_t span) {
  s.ctx.rope = &rope_for(span);
}

void LlamaModel::set_block_checkpoint(size_t block, ActivationCheckpoint::Mode mode) {
  blocks_[block]->set_checkpoint(mode);
}

Tensor LlamaModel::block_forward(ActivationStore& s, size_t block, const Tensor& x) {
  if (!s.blocks[block].has_value()) s.blocks[block] = LlamaBlockActs();
  return blocks_[block]->forward(s.ctx, x, std::any_cast<LlamaBlockActs&>(s.blocks[block]));
}

void LlamaModel::block_backward(ActivationStore& s, size_t block, Tensor& dy) {
  blocks_[block]->backward(s.ctx, dy, std::any_cast<LlamaBlockActs&>(s.blocks[block]));
}

Tensor LlamaModel::embedding_forward(ActivationStore& s) {
  Tensor x = f32({residual_rows(s.ctx), config_.hidden_size}, device_);
  vocab_parallel_embedding_forward(par().tp, s.inputs, s.ctx.tokens(),
                                   embed_unit().params()[0].value, vocab_begin(), x);
  return x;
}

void LlamaModel::embedding_backward(ActivationStore& s, const Tensor& dx) {
  vocab_parallel_embedding_backward(par().tp, s.inputs, s.ctx.tokens(), dx, vocab_begin(),
                                    embed_unit().params()[0].grad);
}

// The final norm, then the output projection fused with the loss, forward and backward.
Tensor LlamaModel::head_forward_backward(ActivationStore& s) {
  const TpRuntime& tp = par().tp;
  const int64_t M = s.ctx.tokens(), Mx = residual_rows(s.ctx), d = config_.hidden_size;
  const Tensor& x = s.head_input;
  Param& norm = head_unit().params()[0];
  Tensor rstd = f32({Mx}, device_), xf = Tensor::empty({Mx, d}, compute_, device_);
  ops::rmsnorm_forward(x, norm.value, float(config_.rms_norm_eps), xf, rstd);
  Tensor dxf;
  {
    ops::LinearCrossEntropy ce;
    ce.x = xf;
    xf = Tensor();
    if (tp.sp()) ce.x = tp_gather_input(tp, ce.x);
    dxf = tp.on() ? tp_pooled(tp, dist::BufferPurpose::col_dx, {M, d}, DType::f32, device_)
                  : f32({M, d}, device_);
    ParamUnit& out_unit = config_.tie_word_embeddings ? embed_unit() : head_unit();
    const size_t out_index = config_.tie_word_embeddings ? 0 : 1;
    ce.w = out_unit.gemm_weight(out_index);
    ce.dx = dxf;
    ce.dw = out_unit.weight_grad(out_index);
    ce.targets = s.targets;
    ce.V = vocab_rows();
    ce.grad_scale = s.grad_scale;
    const LossChunks chunks = loss_chunks(config_, s.ctx.B, s.ctx.T, compute_);
    ce.chunk_rows = chunks.rows;
    ce.grad_rows = chunks.grad_rows;
    s.loss = vocab_parallel_cross_entropy(tp, ce, vocab_begin(), config_.vocab_size);
  }
  if (tp.on()) dxf = tp_sum_partial(tp, dxf);
  Tensor dx = Tensor::zeros({Mx, d}, DType::f32, device_);
  tp_summed_norm_grad(tp, norm.grad,
                      [&](Tensor& g) { ops::rmsnorm_backward(dxf, x, norm.value, rstd, dx, g); });
  return dx;
}

}  // namespace loom
