#include "model/llama.hpp"

#include <any>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "model/head.hpp"
#include "ops/ops.hpp"

namespace loom {

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
  const VocabSpecs vs = llama_vocab_specs(llama_plan(), config_.vocab_size, config_.hidden_size,
                                          config_.tie_word_embeddings, r, n);
  auto embed = std::make_unique<ParamUnit>("embed", std::vector<ParamSpec>{vs.embedding}, bf,
                                           unit_device(0), shard);
  std::vector<ParamUnit*> block_units;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    blocks_.push_back(
        std::make_unique<LlamaBlock>(config_, l, bf, unit_device(size_t(l) + 1), shard, &par()));
    block_units.push_back(&blocks_.back()->unit());
  }
  set_units(std::move(embed), std::move(block_units),
            std::make_unique<ParamUnit>("head", vs.head, bf,
                                        unit_device(size_t(config_.num_hidden_layers) + 1), shard));
}

std::string LlamaModel::describe() const {
  return str_cat("dim ", config_.hidden_size, ", ", config_.num_hidden_layers, " layers, ",
                 config_.num_attention_heads, "/", config_.num_key_value_heads, " heads, ffn ",
                 config_.intermediate_size, ", vocab ", config_.vocab_size);
}

const ops::Rope& LlamaModel::rope_for(int64_t T) {
  if (rope_.num_positions() >= T) return rope_;
  // On meta its size only, and the device copy where the meta run models a GPU (ops).
  rope_ = ops::rope_table(config_.head_dim(), T, config_.rope_theta, config_.rope_scaling, device_);
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
  vocab_parallel_embedding_forward(par().tp, s.inputs, embed_unit().params()[0].value,
                                   vocab_begin(), x);
  return x;
}

void LlamaModel::embedding_backward(ActivationStore& s, const Tensor& dx) {
  vocab_parallel_embedding_backward(par().tp, s.inputs, dx, vocab_begin(),
                                    embed_unit().params()[0].grad);
}

// The final norm, then the output projection fused with the loss (model/head.hpp): vocabulary-
// parallel over tp, as llama_plan() says, its logits in chunks by the memory budget (loss_chunks).
Tensor LlamaModel::head_forward_backward(ActivationStore& s) {
  const LossChunks chunks = loss_chunks(config_, s.ctx.B, s.ctx.T, compute_);
  const LossHead head{.tp = par().tp,
                      .plan = llama_plan(),
                      .precision = LlamaBlock::kPrecision,
                      .tied = config_.tie_word_embeddings,
                      .M = s.ctx.tokens(),
                      .Mx = residual_rows(s.ctx),
                      .d = config_.hidden_size,
                      .vocab = config_.vocab_size,
                      .eps = float(config_.rms_norm_eps),
                      .compute = compute_,
                      .chunk_rows = chunks.rows,
                      .grad_rows = chunks.grad_rows};
  return head.forward_backward(head_unit(), embed_unit(), s.head_input, s.targets, s.grad_scale,
                               loss_slots_.slot(s.loss.slot));
}

}  // namespace loom
