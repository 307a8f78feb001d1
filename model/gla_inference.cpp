#include "model/gla_inference.hpp"

#include <limits>

#include "core/error.hpp"
#include "ops/ops.hpp"

namespace loom {

Tensor GlaInference::f32(const Shape& s) const {
  return Tensor::empty(s, DType::f32, model_.device());
}

GlaInference::GlaInference(GlaModel& model) : model_(model), c_(model.config()) {
  LOOM_CHECK(ops::computes(model.device()), "GLA generate: the model is on the ",
             device_name(model.device()), " device, where no kernel runs (expected cpu or cuda)");
  LOOM_CHECK(model.tp_size() == 1 && model.cp_size() == 1,
             "GLA generate: runs one process (the model has tp = ", model.tp_size(),
             ", cp = ", model.cp_size(), ")");
  const int64_t C3 = c_.key_dim() + (c_.key_dim() + c_.value_dim()) / c_.kv_groups();
  for (size_t l = 0; l < model.num_blocks(); ++l) {
    Layer layer{&model.block(l), f32({1, c_.num_heads, c_.head_k_dim(), c_.head_v_dim()}), {}};
    if (c_.use_short_conv) layer.conv = f32({c_.conv_size - 1, C3});
    layers_.push_back(std::move(layer));
  }
  reset();
}

void GlaInference::reset() {
  len_ = 0;
  for (Layer& l : layers_) {
    l.S.zero_();
    if (l.conv.defined()) l.conv.zero_();
  }
}

Tensor GlaInference::forward(const int32_t* tokens, int64_t n, bool all_logits) {
  LOOM_CHECK(n > 0, "GLA generate: need at least one token, got ", n);
  const DType dt = model_.compute_dtype();
  const int64_t d = c_.hidden_size, H = c_.num_heads, Hkv = c_.num_kv_heads, G = c_.kv_groups();
  const int64_t Kd = c_.key_dim(), Kg = Kd / G, Vd = c_.value_dim(), Vg = Vd / G;
  const int64_t rank = c_.gate_low_rank_dim, F = c_.intermediate_size;
  const int64_t nproj = Kd + Kg + Vg + (c_.use_output_gate ? Vd : 0) + rank, C3 = Kd + Kg + Vg;
  const float eps = float(c_.norm_eps), normalizer = float(c_.gate_logit_normalizer);
  const float clamp =
      c_.has_clamp_min ? float(c_.clamp_min) : -std::numeric_limits<float>::infinity();
  Tensor none;

  Tensor x = f32({n, d});
  ops::embedding_forward(
      ops::index_tensor({tokens, size_t(n)}, model_.device(), "token", 0, c_.vocab_size),
      model_.embedding().params()[0].value, x);
  for (Layer& layer : layers_) {
    const ParamUnit& u = layer.block->unit();
    const auto& P = u.params();
    const GlaBlock::Index& ix = layer.block->index();
    Tensor xn = f32({n, d}), rstd = f32({n}), proj = f32({n, nproj});
    ops::rmsnorm_forward(x, P[size_t(ix.norm1)].value, eps, xn, rstd);
    ops::linear(ops::to_compute(xn, dt), u.gemm_weight(size_t(ix.q)), proj);

    // q | k | v, through the short convolution over (saved history | new rows) when it is on.
    Tensor src = proj;
    int64_t first = 0;
    if (c_.use_short_conv) {
      const int64_t W1 = c_.conv_size - 1, rows = W1 + n;
      Tensor hist = f32({rows, C3}), conv = f32({rows, C3});
      Tensor old_rows = hist.narrow(0, 0, W1), new_rows = hist.narrow(0, W1, n);
      if (W1 > 0) ops::copy_rows(layer.conv, old_rows);
      ops::copy_rows(proj.narrow(1, 0, C3), new_rows);
      const int64_t off[3] = {0, Kd, Kd + Kg}, width[3] = {Kd, Kg, Vg};
      for (int i = 0; i < 3; ++i) {
        Tensor dst = conv.narrow(1, off[i], width[i]);
        ops::short_conv_forward(hist.narrow(1, off[i], width[i]), P[size_t(ix.conv + i)].value, 1,
                                dst);
      }
      if (W1 > 0) ops::copy_rows(hist.narrow(0, n, W1), layer.conv);
      src = conv;
      first = W1;
    }
    const Tensor q = src.narrow(0, first, n).narrow(1, 0, Kd);
    const Tensor k = src.narrow(0, first, n).narrow(1, Kd, Kg);
    const Tensor v = src.narrow(0, first, n).narrow(1, Kd + Kg, Vg);

    Tensor r = f32({n, rank}), gk = f32({n, Kg});
    ops::copy_rows(proj.narrow(1, nproj - rank, rank), r);
    ops::linear(ops::to_compute(r, dt), u.gemm_weight(size_t(ix.gk1)), gk);
    ops::gla_gate_forward(gk, P[size_t(ix.gb1)].value, normalizer, clamp, gk);

    // The core from the saved state; the new state replaces it.
    Tensor o = f32({n, Vd}), S = f32(layer.S.shape());
    ops::gla_forward({1, H, Hkv}, q, k, v, gk, layer.S, o, S);
    layer.S = S;
    const Tensor gate = c_.use_output_gate ? proj.narrow(1, Kd + Kg + Vg, Vd) : none;
    const Tensor wn = ix.gnorm < 0 ? none : P[size_t(ix.gnorm)].value;
    Tensor y = f32({n, Vd}), rstd_o = f32({n * H});
    ops::gated_rmsnorm_forward(o, gate, wn, H, eps, y, rstd_o);
    ops::linear(ops::to_compute(y, dt), u.gemm_weight(size_t(ix.o)), x, true);

    Tensor xn2 = f32({n, d}), gu = f32({n, 2 * F}), act = f32({n, F});
    ops::rmsnorm_forward(x, P[size_t(ix.norm2)].value, eps, xn2, rstd);
    ops::linear(ops::to_compute(xn2, dt), u.gemm_weight(size_t(ix.gate)), gu);
    ops::swiglu_forward(gu, act);
    ops::linear(ops::to_compute(act, dt), u.gemm_weight(size_t(ix.down)), x, true);
  }
  len_ += n;

  const int64_t rows = all_logits ? n : 1;
  Tensor last = x.narrow(0, n - rows, rows), xf = f32({rows, d}), rstd = f32({rows});
  ops::rmsnorm_forward(last, model_.head().params()[0].value, eps, xf, rstd);
  const ParamUnit& out = c_.tie_word_embeddings ? model_.embedding() : model_.head();
  logits_ = f32({rows, c_.vocab_size});
  ops::linear(ops::to_compute(xf, dt), out.gemm_weight(c_.tie_word_embeddings ? 0 : 1), logits_);
  return all_logits ? logits_ : logits_[0];
}

}  // namespace loom
