#include "model/moe_inference.hpp"

namespace loom {

MoeInference::MoeInference(MoeModel& model, int64_t max_len)
    : KvCacheDecoder(model, model.config().base, model.config().head_dim, max_len),
      model_(model),
      c_(model.config()) {
  LOOM_CHECK(int64_t(units().size()) == c_.base.num_hidden_layers + c_.num_sparse_layers() + 2,
             "inference: expected ", c_.base.num_hidden_layers + c_.num_sparse_layers() + 2,
             " parameter units, got ", units().size(),
             " (a model built whole on one process: no expert or pipeline parallelism)");
}

void MoeInference::run_layers(Tensor& x) {
  const int64_t n = x.size(0), d = c_.base.hidden_size, hd = c_.head_dim;
  const int64_t Hq = c_.base.num_attention_heads, Hkv = c_.base.num_key_value_heads;
  // The blocks' branches take their rows and dtype from a step's context: the chunk's.
  StepContext ctx;
  ctx.B = 1;
  ctx.T = n;
  ctx.compute = compute_;
  Tensor xn = f32({n, d}), rstd = f32({n});
  Tensor qkv = f32({n, (Hq + 2 * Hkv) * hd}), attn = f32({n, Hq * hd});
  for (int64_t l = 0; l < c_.base.num_hidden_layers; ++l) {
    MoeAttentionBlock& block = model_.attention_block(l);
    const ParamUnit& u = block.unit();
    const Attention at = block.attention(ctx);
    // Attention: x += o(attention(rope(norms(qkv(norm1(x)) + biases)))), with this chunk's k, v
    // appended to the cache first.
    ops::rmsnorm_forward(x, u.params()[at.norm].value, at.eps, xn, rstd);
    ops::linear(gemm_input(xn), u.gemm_weight(at.q), qkv);
    if (at.qkv_bias != Attention::kNone) at.add_biases(u, qkv);
    if (at.qk_norm != Attention::kNone) {
      AttentionActs unused;  // what the training forward saves for its backward
      at.qk_norm_forward(u, qkv, unused);
    }
    attend(size_t(l), qkv, attn);
    ops::linear(gemm_input(attn), u.gemm_weight(at.o), x, true);
    // The feed-forward branch, each a new residual stream: a dense layer's MLP, or the router
    // (its statistics feed only training's auxiliary loss) and the chosen experts.
    if (!block.sparse()) {
      MlpActs a;
      a.h = x;
      x = block.mlp(ctx).forward(u, a);
      continue;
    }
    MoeRouting routing;
    routing.h = x;
    RouterStats stats;
    block.router(ctx).forward(u, routing, stats);
    MoeExpertsBlock& experts = *model_.experts_block(l);
    MoeExpertsActs a;
    x = experts.experts(ctx).forward(experts.unit(), routing, a);
  }
}

}  // namespace loom
