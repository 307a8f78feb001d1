#include "model/llama.hpp"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/rope.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "model/safetensors.hpp"

namespace loom {

namespace {

Tensor f32(const Shape& s, Device d) {
  return Tensor::empty(s, DType::f32, d);
}

bool live(const Tensor& t) {
  return t.device() != Device::meta;
}

// A GEMM input in the compute dtype: the tensor itself in f32, a rounded copy in bf16.
Tensor to_compute(const Tensor& x, DType dt) {
  if (dt == DType::f32) return x;
  Tensor y = Tensor::empty(x.shape(), DType::bf16, x.device());
  if (live(x)) cpu::cast_f32_to_bf16(x.data<float>(), y.data<bf16>(), x.numel());
  return y;
}

// y[M,N] (+)= x[M,K] * w[N,K]^T
void linear(const Tensor& x, const void* w, Tensor& y, int64_t N, int64_t K, DType dt,
            bool accumulate) {
  if (live(y))
    cpu::linear_forward(x.raw(), w, y.data<float>(), x.numel() / K, N, K, dt, accumulate);
}

// dx = dy * w, dw += dy^T x for y = x w^T with x [M,K], w [N,K].
void linear_backward(const Tensor& dy, const Tensor& x, const void* w, float* dw, Tensor* dx,
                     int64_t N, int64_t K, DType dt) {
  if (!live(dy)) return;
  int64_t M = dy.numel() / N;
  if (dx) cpu::linear_backward_input(dy.raw(), w, dx->data<float>(), M, N, K, dt, false);
  cpu::linear_backward_weight(dy.raw(), x.raw(), dw, M, N, K, dt);
}

}  // namespace

size_t BlockActs::bytes() const {
  size_t n = 0;
  for (const Tensor* t : {&x, &rstd1, &xn1, &qkv, &attn, &lse, &h, &rstd2, &xn2, &gu, &act})
    if (t->defined()) n += t->nbytes();
  return n;
}

static std::vector<ParamSpec> block_specs(const LlamaConfig& c, int64_t layer) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t d = c.hidden_size, hd = c.head_dim(), F = c.intermediate_size;
  const int64_t q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  // Output projections of the residual branches start smaller (GPT-2 / Megatron scaled init), so
  // the residual stream's variance does not grow with depth.
  const float out_std = 0.02f / std::sqrt(2.0f * float(c.num_hidden_layers));
  return {
      {p + "input_layernorm.weight", {d}, Init::ones, 0, false, true},
      {p + "self_attn.q_proj.weight", {q, d}},
      {p + "self_attn.k_proj.weight", {kv, d}},
      {p + "self_attn.v_proj.weight", {kv, d}},
      {p + "self_attn.o_proj.weight", {d, q}, Init::normal, out_std},
      {p + "post_attention_layernorm.weight", {d}, Init::ones, 0, false, true},
      {p + "mlp.gate_proj.weight", {F, d}},
      {p + "mlp.up_proj.weight", {F, d}},
      {p + "mlp.down_proj.weight", {d, F}, Init::normal, out_std},
  };
}

TransformerBlock::TransformerBlock(const LlamaConfig& c, int64_t layer, bool bf16, Device device,
                                   ShardLayout shard)
    : c_(c), unit_("layers." + std::to_string(layer), block_specs(c, layer), bf16, device, shard) {}

Tensor TransformerBlock::forward(const StepContext& ctx, const Tensor& x, BlockActs& a) const {
  const int64_t M = ctx.tokens(), d = c_.hidden_size, hd = c_.head_dim();
  const int64_t Hq = c_.num_attention_heads, Hkv = c_.num_key_value_heads;
  const int64_t F = c_.intermediate_size, nqkv = (Hq + 2 * Hkv) * hd;
  const auto& P = unit_.params();
  const Device dev = x.device();
  const DType dt = ctx.compute;
  const float eps = float(c_.rms_norm_eps);
  const bool run = live(x);

  a.x = x;
  a.rstd1 = f32({M}, dev);
  {
    Tensor xn1 = f32({M, d}, dev);
    if (run)
      cpu::rmsnorm_forward(x.data<float>(), P[kNorm1].value.data<float>(), M, d, eps,
                           xn1.data<float>(), a.rstd1.data<float>());
    a.xn1 = to_compute(xn1, dt);
  }
  a.qkv = f32({M, nqkv}, dev);
  linear(a.xn1, unit_.gemm_weights(kQ), a.qkv, nqkv, d, dt, false);
  a.attn = f32({M, Hq * hd}, dev);
  a.lse = f32({ctx.B, Hq, ctx.T}, dev);
  if (run) {
    float* q = a.qkv.data<float>();
    cpu::rope_forward(q, ctx.B, ctx.T, Hq, hd, nqkv, ctx.positions.data(), *ctx.rope);
    cpu::rope_forward(q + Hq * hd, ctx.B, ctx.T, Hkv, hd, nqkv, ctx.positions.data(), *ctx.rope);
    cpu::AttentionShape s{ctx.B, ctx.T, Hq, Hkv, hd, nqkv, nqkv, 1.0f / std::sqrt(float(hd))};
    cpu::attention_forward(s, q, q + Hq * hd, q + (Hq + Hkv) * hd, a.attn.data<float>(),
                           a.lse.data<float>());
  }
  a.h = f32({M, d}, dev);
  a.h.copy_from(x);
  linear(to_compute(a.attn, dt), unit_.gemm_weights(kO), a.h, d, Hq * hd, dt, true);

  a.rstd2 = f32({M}, dev);
  {
    Tensor xn2 = f32({M, d}, dev);
    if (run)
      cpu::rmsnorm_forward(a.h.data<float>(), P[kNorm2].value.data<float>(), M, d, eps,
                           xn2.data<float>(), a.rstd2.data<float>());
    a.xn2 = to_compute(xn2, dt);
  }
  a.gu = f32({M, 2 * F}, dev);
  linear(a.xn2, unit_.gemm_weights(kGate), a.gu, 2 * F, d, dt, false);
  {
    Tensor act = f32({M, F}, dev);
    if (run) cpu::swiglu_forward(a.gu.data<float>(), M, F, act.data<float>());
    a.act = to_compute(act, dt);
  }
  Tensor out = f32({M, d}, dev);
  out.copy_from(a.h);
  linear(a.act, unit_.gemm_weights(kDown), out, d, F, dt, true);
  return out;
}

void TransformerBlock::backward(const StepContext& ctx, Tensor& dy, BlockActs& a) {
  const int64_t M = ctx.tokens(), d = c_.hidden_size, hd = c_.head_dim();
  const int64_t Hq = c_.num_attention_heads, Hkv = c_.num_key_value_heads;
  const int64_t F = c_.intermediate_size, nqkv = (Hq + 2 * Hkv) * hd;
  auto& P = unit_.params();
  const Device dev = dy.device();
  const DType dt = ctx.compute;
  const bool run = live(dy);

  // MLP branch: out = h + down(swiglu(gate_up(norm2(h)))).
  {
    // The gate/up gradient overwrites the saved gate/up projections (last read here).
    Tensor dgu = a.gu;
    a.gu = Tensor();
    {
      Tensor dact = f32({M, F}, dev);
      linear_backward(to_compute(dy, dt), a.act, unit_.gemm_weights(kDown), unit_.grad_data(kDown),
                      &dact, d, F, dt);
      a.act = Tensor();
      if (run) cpu::swiglu_backward(dact.data<float>(), dgu.data<float>(), M, F, dgu.data<float>());
    }
    Tensor dxn2 = f32({M, d}, dev);
    linear_backward(to_compute(dgu, dt), a.xn2, unit_.gemm_weights(kGate), unit_.grad_data(kGate),
                    &dxn2, 2 * F, d, dt);
    a.xn2 = Tensor();
    if (run)
      cpu::rmsnorm_backward(dxn2.data<float>(), a.h.data<float>(), P[kNorm2].value.data<float>(),
                            a.rstd2.data<float>(), M, d, dy.data<float>(), unit_.grad_data(kNorm2));
    a.h = a.rstd2 = Tensor();
  }
  // Attention branch: h = x + o(attention(rope(qkv(norm1(x))))).
  {
    Tensor dqkv = f32({M, nqkv}, dev);
    {
      Tensor dattn = f32({M, Hq * hd}, dev);
      linear_backward(to_compute(dy, dt), to_compute(a.attn, dt), unit_.gemm_weights(kO),
                      unit_.grad_data(kO), &dattn, d, Hq * hd, dt);
      if (run) {
        const float* q = a.qkv.data<float>();
        float* dq = dqkv.data<float>();
        cpu::AttentionShape s{ctx.B, ctx.T, Hq, Hkv, hd, nqkv, nqkv, 1.0f / std::sqrt(float(hd))};
        cpu::attention_backward(s, q, q + Hq * hd, q + (Hq + Hkv) * hd, a.attn.data<float>(),
                                a.lse.data<float>(), dattn.data<float>(), dq, dq + Hq * hd,
                                dq + (Hq + Hkv) * hd);
        cpu::rope_backward(dq, ctx.B, ctx.T, Hq, hd, nqkv, ctx.positions.data(), *ctx.rope);
        cpu::rope_backward(dq + Hq * hd, ctx.B, ctx.T, Hkv, hd, nqkv, ctx.positions.data(),
                           *ctx.rope);
      }
      a.attn = a.lse = a.qkv = Tensor();
    }
    Tensor dxn1 = f32({M, d}, dev);
    linear_backward(to_compute(dqkv, dt), a.xn1, unit_.gemm_weights(kQ), unit_.grad_data(kQ), &dxn1,
                    nqkv, d, dt);
    a.xn1 = Tensor();
    if (run)
      cpu::rmsnorm_backward(dxn1.data<float>(), a.x.data<float>(), P[kNorm1].value.data<float>(),
                            a.rstd1.data<float>(), M, d, dy.data<float>(), unit_.grad_data(kNorm1));
  }
  a = BlockActs();
}

LlamaModel::LlamaModel(const LlamaConfig& config, DType compute, Device device, ShardLayout shard)
    : config_(config), compute_(compute), device_(device), shard_(shard) {
  config_.validate("model config");
  LOOM_CHECK(compute == DType::f32 || compute == DType::bf16,
             "compute dtype must be float32 or bfloat16, got ", dtype_name(compute));
  const bool bf = compute == DType::bf16;
  const int64_t d = config_.hidden_size, V = config_.vocab_size;
  embed_ = std::make_unique<ParamUnit>(
      "embed",
      std::vector<ParamSpec>{
          {"model.embed_tokens.weight", {V, d}, Init::normal, 0.02f, true, true}},
      bf, device, shard);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l)
    blocks_.push_back(std::make_unique<TransformerBlock>(config_, l, bf, device, shard));
  std::vector<ParamSpec> head{{"model.norm.weight", {d}, Init::ones, 0, false, true}};
  if (!config_.tie_word_embeddings) head.push_back({"lm_head.weight", {V, d}});
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
      for (auto& p : u->params()) dir.read_f32(p.spec.name, p.spec.shape, p.value.data<float>());
      u->refresh_bf16();
      continue;
    }
    // Only the rows that hold this rank's slice are read (and converted).
    float* shard = u->master_shard().data<float>();
    std::vector<float> rows;
    for (const ShardSlice& s : u->shard_slices()) {
      const ParamSpec& spec = u->params()[s.param].spec;
      const int64_t row = spec.shape.empty() ? 1 : shape_numel(spec.shape) / spec.shape[0];
      const int64_t r0 = s.begin / row, r1 = (s.begin + s.count - 1) / row + 1;
      rows.resize(size_t((r1 - r0) * row));
      dir.read_f32(spec.name, spec.shape, rows.data(), r0, r1 - r0);
      std::copy_n(rows.data() + (s.begin - r0 * row), s.count, shard + s.shard_offset);
    }
  }
}

void LlamaModel::zero_grad() {
  for (ParamUnit* u : units()) u->zero_grad();
}

const cpu::RopeTable& LlamaModel::rope_for(int64_t T) {
  if (rope_.num_positions < T)
    rope_ = cpu::rope_table(config_.head_dim(), T, config_.rope_theta, config_.rope_scaling);
  return rope_;
}

double LlamaModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                    int64_t T, float grad_scale) {
  const int64_t M = B * T, d = config_.hidden_size, V = config_.vocab_size;
  const bool run = device_ != Device::meta;
  StepContext ctx;
  ctx.B = B;
  ctx.T = T;
  ctx.compute = compute_;
  ctx.positions.resize(T);
  for (int64_t t = 0; t < T; ++t) ctx.positions[t] = int32_t(t);
  ctx.rope = &rope_for(T);

  LOOM_CHECK(hooks_ || !shard_.sharded(),
             "forward_backward: a sharded model needs hooks that materialize its units");
  const size_t head_unit = blocks_.size() + 1;
  auto hook = [this](void (UnitHooks::*fn)(size_t), size_t unit) {
    if (hooks_) (hooks_->*fn)(unit);
  };

  Tensor x = f32({M, d}, device_);
  hook(&UnitHooks::before_forward, 0);
  if (run)
    cpu::embedding_forward(inputs, M, embed_->params()[0].value.data<float>(), V, d,
                           x.data<float>());
  hook(&UnitHooks::after_forward, 0);

  std::vector<BlockActs> acts(blocks_.size());
  for (size_t l = 0; l < blocks_.size(); ++l) {
    hook(&UnitHooks::before_forward, l + 1);
    x = blocks_[l]->forward(ctx, x, acts[l]);
    hook(&UnitHooks::after_forward, l + 1);
  }

  // Head: final norm, then the output projection fused with the loss (forward and backward).
  Tensor dx;
  double loss = 0;
  hook(&UnitHooks::before_forward, head_unit);
  hook(&UnitHooks::after_forward, head_unit);
  hook(&UnitHooks::before_backward, head_unit);
  {
    const Param& norm = head_->params()[0];
    Tensor rstd = f32({M}, device_), xf = f32({M, d}, device_);
    if (run)
      cpu::rmsnorm_forward(x.data<float>(), norm.value.data<float>(), M, d,
                           float(config_.rms_norm_eps), xf.data<float>(), rstd.data<float>());
    Tensor xf_c = to_compute(xf, compute_);
    xf = Tensor();
    ParamUnit& out_unit = config_.tie_word_embeddings ? *embed_ : *head_;
    const size_t out_index = config_.tie_word_embeddings ? 0 : 1;
    Tensor dxf = f32({M, d}, device_);
    if (run) {
      cpu::LinearCrossEntropyArgs ce;
      ce.x = xf_c.raw();
      ce.w = out_unit.gemm_weights(out_index);
      ce.ab = compute_;
      ce.targets = targets;
      ce.N = M;
      ce.D = d;
      ce.V = V;
      ce.grad_scale = grad_scale;
      ce.dx = dxf.data<float>();
      ce.dw = out_unit.grad_data(out_index);
      ce.chunk_rows = loss_chunk_rows(config_, B, T, compute_);
      loss = cpu::linear_cross_entropy(ce);
    }
    xf_c = Tensor();
    dx = Tensor::zeros({M, d}, DType::f32, device_);
    if (run) {
      cpu::rmsnorm_backward(dxf.data<float>(), x.data<float>(), norm.value.data<float>(),
                            rstd.data<float>(), M, d, dx.data<float>(), head_->grad_data(0));
    }
  }
  hook(&UnitHooks::after_backward, head_unit);
  x = Tensor();
  for (size_t l = blocks_.size(); l-- > 0;) {
    hook(&UnitHooks::before_backward, l + 1);
    blocks_[l]->backward(ctx, dx, acts[l]);
    hook(&UnitHooks::after_backward, l + 1);
  }
  hook(&UnitHooks::before_backward, 0);
  if (run) cpu::embedding_backward(inputs, M, dx.data<float>(), V, d, embed_->grad_data(0));
  hook(&UnitHooks::after_backward, 0);
  return loss;
}

int64_t LlamaModel::loss_chunk_rows(const LlamaConfig& c, int64_t B, int64_t T, DType compute) {
  // The fused loss's workspace (f32 logits, plus their bf16 gradient in bf16 mode) is held to 2%
  // of the step's saved activations, so the peak stays what the memory model predicts; larger
  // chunks are a few percent faster (fewer passes over dW) but would be memory nobody planned for.
  const double per_row = double(c.vocab_size) * (4 + (compute == DType::bf16 ? 2 : 0));
  const auto budget = 0.02 * double(saved_activation_bytes(c, B, T, compute));
  const int64_t rows = int64_t(budget / per_row) / 16 * 16;
  return std::clamp<int64_t>(rows, std::min<int64_t>(64, B * T), B * T);
}

size_t LlamaModel::saved_activation_bytes(const LlamaConfig& c, int64_t B, int64_t T,
                                          DType compute) {
  const size_t M = size_t(B * T), d = c.hidden_size, hd = c.head_dim();
  const size_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, F = c.intermediate_size;
  const size_t cs = dtype_size(compute);
  // x, h (f32); xn1, xn2 (compute dtype); rstd1, rstd2; qkv, attn, lse (f32); gu (f32); act.
  size_t per_block = M * d * 4 * 2 + M * d * cs * 2 + M * 4 * 2 + M * (Hq + 2 * Hkv) * hd * 4 +
                     M * Hq * hd * 4 + size_t(B) * Hq * size_t(T) * 4 + M * 2 * F * 4 + M * F * cs;
  return per_block * size_t(c.num_hidden_layers);
}

}  // namespace loom
