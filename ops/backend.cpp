#include "ops/backend.hpp"

#include <chrono>

#include "core/error.hpp"

namespace loom::ops {

double Backend::timed(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Backend::missing(const char* op) const {
  fail(op, ": no kernel on device ", device_name(device_), " yet");
}

// Every op a backend does not override: an error naming it.
void Backend::cast(const Tensor& /*src*/, Tensor& /*dst*/) {
  missing("cast");
}

void Backend::add_inplace(Tensor& /*y*/, const Tensor& /*x*/) {
  missing("add_inplace");
}

void Backend::fill(Tensor& /*x*/, float /*value*/) {
  missing("fill");
}

void Backend::copy_rows(const Tensor& /*src*/, Tensor& /*dst*/) {
  missing("copy_rows");
}

void Backend::philox_normal(Tensor& /*x*/, uint64_t /*key*/, int64_t /*first*/, float /*std*/) {
  missing("philox_normal");
}

void Backend::adamw_step(const AdamWStep& /*a*/, Tensor& /*p*/, const Tensor& /*g*/, Tensor& /*m*/,
                         Tensor& /*v*/, Tensor* /*mirror*/) {
  missing("adamw_step");
}

void Backend::sum_squares_each(std::span<const Tensor> xs, std::span<double> out) {
  for (size_t i = 0; i < xs.size(); ++i) out[i] = sum_squares(xs[i]);
}

double Backend::sum_squares(const Tensor& /*x*/) {
  missing("sum_squares");
}

void Backend::scale_inplace(Tensor& /*x*/, float /*s*/) {
  missing("scale_inplace");
}

void Backend::linear(const Tensor& /*x*/, const Tensor& /*w*/, Tensor& /*y*/, bool /*accumulate*/) {
  missing("linear");
}

void Backend::linear_residual(const Tensor& /*x*/, const Tensor& /*w*/, const Tensor& /*r*/,
                              Tensor& /*y*/) {
  missing("linear_residual");
}

void Backend::linear_backward_input(const Tensor& /*dy*/, const Tensor& /*w*/, Tensor& /*dx*/) {
  missing("linear_backward_input");
}

void Backend::linear_backward_weight(const Tensor& /*dy*/, const Tensor& /*x*/, Tensor& /*dw*/,
                                     bool /*add*/) {
  missing("linear_backward_weight");
}

void Backend::rmsnorm_forward(const Tensor& /*x*/, const Tensor& /*w*/, float /*eps*/,
                              Tensor& /*y*/, Tensor& /*rstd*/) {
  missing("rmsnorm_forward");
}

void Backend::rmsnorm_forward_rounding_input(Tensor& /*x*/, Tensor& /*x16*/, const Tensor& /*w*/,
                                             float /*eps*/, Tensor& /*y*/, Tensor& /*rstd*/) {
  missing("rmsnorm_forward_rounding_input");
}

void Backend::rmsnorm_backward(const Tensor& /*dy*/, const Tensor& /*x*/, const Tensor& /*w*/,
                               const Tensor& /*rstd*/, Tensor& /*dx*/, Tensor& /*dw*/) {
  missing("rmsnorm_backward");
}

void Backend::swiglu_forward(const Tensor& /*gu*/, Tensor& /*act*/) {
  missing("swiglu_forward");
}

void Backend::swiglu_backward(const Tensor& /*dact*/, const Tensor& /*gu*/, Tensor& /*dgu*/) {
  missing("swiglu_backward");
}

void Backend::rope(Tensor& /*x*/, int64_t /*B*/, int64_t /*H*/, const Tensor& /*positions*/,
                   const Rope& /*table*/, bool /*backward*/) {
  missing("rope");
}

void Backend::rope_rounded(const Tensor& /*x*/, int64_t /*B*/, int64_t /*H*/, int64_t /*Hc*/,
                           const Tensor& /*positions*/, const Rope& /*table*/, bool /*backward*/,
                           Tensor& /*out*/) {
  missing("rope_rounded");
}

void Backend::embedding_forward(const Tensor& /*tokens*/, const Tensor& /*table*/, int64_t /*v0*/,
                                Tensor& /*out*/) {
  missing("embedding_forward");
}

void Backend::embedding_backward(const Tensor& /*tokens*/, const Tensor& /*dout*/, int64_t /*v0*/,
                                 Tensor& /*dtable*/) {
  missing("embedding_backward");
}

void Backend::attention_forward(const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/,
                                int64_t /*B*/, int64_t /*Hq*/, int64_t /*Hkv*/, Tensor& /*out*/,
                                Tensor& /*lse*/) {
  missing("attention_forward");
}

void Backend::attention_backward(const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/,
                                 const Tensor& /*out*/, const Tensor& /*lse*/,
                                 const Tensor& /*dout*/, int64_t /*B*/, int64_t /*Hq*/,
                                 int64_t /*Hkv*/, Tensor& /*dq*/, Tensor& /*dk*/, Tensor& /*dv*/) {
  missing("attention_backward");
}

void Backend::attention_decode(const Tensor& /*q*/, const Tensor& /*k*/, const Tensor& /*v*/,
                               int64_t /*L*/, int64_t /*Hq*/, int64_t /*Hkv*/, Tensor& /*out*/) {
  missing("attention_decode");
}

void Backend::attention_block_forward(const AttentionBlock& /*s*/, const Tensor& /*q*/,
                                      const Tensor& /*k*/, const Tensor& /*v*/, Tensor& /*out*/,
                                      Tensor& /*lse*/, const std::function<void()>& /*progress*/) {
  missing("attention_block_forward");
}

void Backend::attention_block_backward(const AttentionBlock& /*s*/, const Tensor& /*q*/,
                                       const Tensor& /*k*/, const Tensor& /*v*/,
                                       const Tensor& /*lse*/, const Tensor& /*delta*/,
                                       const Tensor& /*dout*/, Tensor& /*dq*/, Tensor& /*dk*/,
                                       Tensor& /*dv*/, const std::function<void()>& /*progress*/) {
  missing("attention_block_backward");
}

void Backend::attention_merge(int64_t /*B*/, int64_t /*Hq*/, Tensor& /*out*/, Tensor& /*lse*/,
                              const Tensor& /*out_b*/, const Tensor& /*lse_b*/) {
  missing("attention_merge");
}

void Backend::attention_delta(int64_t /*B*/, int64_t /*Hq*/, const Tensor& /*out*/,
                              const Tensor& /*dout*/, Tensor& /*delta*/) {
  missing("attention_delta");
}

void Backend::gla_forward(const Gla& /*s*/, const Tensor& /*q*/, const Tensor& /*k*/,
                          const Tensor& /*v*/, const Tensor& /*gk*/, const Tensor& /*h0*/,
                          Tensor& /*o*/, Tensor& /*ht*/) {
  missing("gla_forward");
}

void Backend::gla_backward(const Gla& /*s*/, const Tensor& /*q*/, const Tensor& /*k*/,
                           const Tensor& /*v*/, const Tensor& /*gk*/, const Tensor& /*h0*/,
                           const Tensor& /*dout*/, const Tensor& /*dht*/, Tensor& /*dq*/,
                           Tensor& /*dk*/, Tensor& /*dv*/, Tensor& /*dgk*/, Tensor& /*dh0*/) {
  missing("gla_backward");
}

void Backend::gla_decay_total(const Gla& /*s*/, const Tensor& /*gk*/, Tensor& /*decay*/) {
  missing("gla_decay_total");
}

void Backend::gla_state_fold(const Gla& /*s*/, const Tensor& /*decay*/, const Tensor& /*E*/,
                             Tensor& /*S*/) {
  missing("gla_state_fold");
}

void Backend::gla_gate_forward(const Tensor& /*z*/, const Tensor& /*bias*/, float /*normalizer*/,
                               float /*clamp_min*/, Tensor& /*gk*/) {
  missing("gla_gate_forward");
}

void Backend::gla_gate_backward(const Tensor& /*dgk*/, const Tensor& /*z*/, const Tensor& /*bias*/,
                                float /*normalizer*/, float /*clamp_min*/, Tensor& /*dz*/,
                                Tensor& /*dbias*/) {
  missing("gla_gate_backward");
}

void Backend::gated_rmsnorm_forward(const Tensor& /*x*/, const Tensor& /*g*/, const Tensor& /*w*/,
                                    int64_t /*heads*/, float /*eps*/, Tensor& /*y*/,
                                    Tensor& /*rstd*/) {
  missing("gated_rmsnorm_forward");
}

void Backend::gated_rmsnorm_backward(const Tensor& /*dy*/, const Tensor& /*x*/, const Tensor& /*g*/,
                                     const Tensor& /*w*/, const Tensor& /*rstd*/, int64_t /*heads*/,
                                     Tensor& /*dx*/, Tensor& /*dg*/, Tensor& /*dw*/) {
  missing("gated_rmsnorm_backward");
}

void Backend::short_conv_forward(const Tensor& /*x*/, const Tensor& /*w*/, int64_t /*B*/,
                                 Tensor& /*y*/) {
  missing("short_conv_forward");
}

void Backend::short_conv_backward(const Tensor& /*dy*/, const Tensor& /*x*/, const Tensor& /*w*/,
                                  int64_t /*B*/, Tensor& /*dx*/, Tensor& /*dw*/) {
  missing("short_conv_backward");
}

void Backend::moe_route(const Tensor& /*logits*/, const Tensor& /*bias*/, bool /*renormalize*/,
                        Tensor& /*probs*/, Tensor& /*experts*/, Tensor& /*weights*/,
                        Tensor& /*prob_sum*/) {
  missing("moe_route");
}

void Backend::moe_route_backward(const Tensor& /*probs*/, const Tensor& /*experts*/,
                                 const Tensor& /*weights*/, const Tensor& /*dweights*/,
                                 bool /*renormalize*/, const Tensor& /*dprob*/,
                                 Tensor& /*dlogits*/) {
  missing("moe_route_backward");
}

int64_t Backend::moe_permute(const Tensor& /*experts*/, int64_t /*E*/,
                             std::span<const int64_t> /*capacity*/, Tensor& /*pos*/,
                             std::vector<int64_t>& /*counts*/) {
  missing("moe_permute");
}

void Backend::moe_permute_order(const Tensor& /*pos*/, Tensor& /*order*/) {
  missing("moe_permute");
}

void Backend::moe_dispatch(const Tensor& /*x*/, const Tensor& /*order*/, int64_t /*k*/,
                           Tensor& /*xs*/) {
  missing("moe_dispatch");
}

void Backend::moe_dispatch_backward(const Tensor& /*dxs*/, const Tensor& /*pos*/, int64_t /*k*/,
                                    Tensor& /*dx*/, bool /*accumulate*/) {
  missing("moe_dispatch_backward");
}

void Backend::moe_combine(const Tensor& /*ys*/, const Tensor& /*weights*/, const Tensor& /*pos*/,
                          Tensor& /*y*/) {
  missing("moe_combine");
}

void Backend::moe_combine_backward(const Tensor& /*dy*/, const Tensor& /*ys*/,
                                   const Tensor& /*weights*/, const Tensor& /*pos*/,
                                   Tensor& /*dys*/, Tensor& /*dweights*/) {
  missing("moe_combine_backward");
}

void Backend::add_bias(Tensor& /*y*/, const Tensor& /*b*/) {
  missing("add_bias");
}

void Backend::bias_grad(const Tensor& /*dy*/, Tensor& /*db*/) {
  missing("bias_grad");
}

void Backend::sigmoid_gate_forward(const Tensor& /*z*/, const Tensor& /*ys*/, Tensor& /*y*/) {
  missing("sigmoid_gate_forward");
}

void Backend::sigmoid_gate_backward(const Tensor& /*dy*/, const Tensor& /*z*/, const Tensor& /*ys*/,
                                    Tensor& /*dys*/, Tensor& /*dz*/) {
  missing("sigmoid_gate_backward");
}

void Backend::linear_cross_entropy(const LinearCrossEntropy& /*a*/, bool /*dw_overwrite*/) {
  missing("linear_cross_entropy");
}

void Backend::vocab_shard_lse(const Tensor& /*logits*/, int64_t /*Vr*/, const Tensor& /*targets*/,
                              int64_t /*v0*/, Tensor& /*lse*/, Tensor& /*target_logit*/) {
  missing("vocab_shard_lse");
}

void Backend::vocab_shard_combine(const Tensor& /*lse_all*/, const Tensor& /*targets*/,
                                  const Tensor& /*target_logit*/, Tensor& /*glse*/,
                                  Tensor& /*loss*/) {
  missing("vocab_shard_combine");
}

void Backend::vocab_shard_dlogits(Tensor& /*logits*/, int64_t /*Vr*/, const Tensor& /*targets*/,
                                  int64_t /*v0*/, const Tensor& /*glse*/, float /*grad_scale*/) {
  missing("vocab_shard_dlogits");
}

Backend& backend(const char* op, Device device) {
  switch (device) {
    case Device::cpu:
      return cpu_backend();
    case Device::cuda:
#ifdef LOOM_CUDA_BACKEND
      return cuda_backend();
#else
      fail(op, ": a cuda tensor, but this loom was built without the CUDA backend");
#endif
    default:
      fail(op, ": no kernel for device ", device_name(device));
  }
}

}  // namespace loom::ops
