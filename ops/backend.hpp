#pragma once
// One device's kernels behind the ops (docs/architecture.md "The device seam"). Each op
// of ops.hpp checks its arguments, reports its work to the time model (meta) or the profile, and
// calls one method of the Backend of its tensors' device with the same tensors; the Backend
// picks the kernel by dtype and runs it. cpu_backend.cpp runs kernels/cpu, cuda/cuda_backend.cpp
// kernels/cuda (built with the CUDA backend only); meta has no Backend (it books memory and runs
// nothing). A method a backend does not implement is a loom::Error naming the op and the device.
//
// The arguments are those of the op in ops.hpp, after its checks: shapes and strides are the
// tensors', index arrays (tokens, targets, positions) and the RoPE table on the tensors' device.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "ops/ops.hpp"

namespace loom::ops {

class Backend {
 public:
  explicit Backend(Device device) : device_(device) {}
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  Device device() const { return device_; }
  // Runs `fn` and returns the seconds its work took on the device (the op profile): the wall time
  // on the CPU, events on a GPU's stream.
  virtual double timed(const std::function<void()>& fn);

  // ---- element-wise and copies
  virtual void cast(const Tensor& src, Tensor& dst);  // f32 <-> bf16, same numel, contiguous
  virtual void add_inplace(Tensor& y, const Tensor& x);
  virtual void fill(Tensor& x, float value);
  virtual void copy_rows(const Tensor& src, Tensor& dst);
  virtual void philox_normal(Tensor& x, uint64_t key, int64_t first, float std);

  // ---- optimizer and gradient norm
  virtual void adamw_step(const AdamWStep& a, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                          Tensor* mirror);
  virtual double sum_squares(const Tensor& x);
  // out[i] = sum_squares(xs[i]); by default one call each.
  virtual void sum_squares_each(std::span<const Tensor> xs, std::span<double> out);
  virtual void scale_inplace(Tensor& x, float s);

  // ---- GEMMs (a bf16 y is the product rounded; r: the residual form)
  virtual void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate);
  virtual void linear_residual(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y);
  virtual void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx);
  virtual void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool add);

  // ---- normalization, activation, position
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                               Tensor& rstd);
  virtual void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps,
                                              Tensor& y, Tensor& rstd);
  virtual void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                const Tensor& rstd, Tensor& dx, Tensor& dw);
  virtual void swiglu_forward(const Tensor& gu, Tensor& act);
  virtual void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu);
  virtual void rope(Tensor& x, int64_t B, int64_t H, const Tensor& positions, const Rope& table,
                    bool backward);
  virtual void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc,
                            const Tensor& positions, const Rope& table, bool backward, Tensor& out);

  // ---- embedding (v0 < 0: the whole table; otherwise the rows [v0, v0 + table rows))
  virtual void embedding_forward(const Tensor& tokens, const Tensor& table, int64_t v0,
                                 Tensor& out);
  virtual void embedding_backward(const Tensor& tokens, const Tensor& dout, int64_t v0,
                                  Tensor& dtable);

  // ---- attention
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B,
                                 int64_t Hq, int64_t Hkv, Tensor& out, Tensor& lse);
  virtual void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  int64_t B, int64_t Hq, int64_t Hkv, Tensor& dq, Tensor& dk,
                                  Tensor& dv);
  virtual void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L,
                                int64_t Hq, int64_t Hkv, Tensor& out);
  virtual void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                                       const Tensor& v, Tensor& out, Tensor& lse,
                                       const std::function<void()>& progress);
  virtual void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& lse, const Tensor& delta,
                                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                        const std::function<void()>& progress);
  virtual void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                               const Tensor& lse_b);
  virtual void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout,
                               Tensor& delta);

  // ---- GLA
  virtual void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& gk, const Tensor& h0, Tensor& o, Tensor& ht);
  virtual void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& gk, const Tensor& h0, const Tensor& dout,
                            const Tensor& dht, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dgk,
                            Tensor& dh0);
  virtual void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay);
  virtual void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S);
  virtual void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer,
                                float clamp_min, Tensor& gk);
  virtual void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias,
                                 float normalizer, float clamp_min, Tensor& dz, Tensor& dbias);
  virtual void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w,
                                     int64_t heads, float eps, Tensor& y, Tensor& rstd);
  virtual void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g,
                                      const Tensor& w, const Tensor& rstd, int64_t heads,
                                      Tensor& dx, Tensor& dg, Tensor& dw);
  virtual void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y);
  virtual void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B,
                                   Tensor& dx, Tensor& dw);

  // ---- mixture of experts (moe_permute: pos [M*k] and counts [E] filled, the dropped returned;
  // moe_permute_order: order [N] from pos)
  virtual void moe_route(const Tensor& logits, const Tensor& bias, bool renormalize, Tensor& probs,
                         Tensor& experts, Tensor& weights, Tensor& prob_sum);
  virtual void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                                  const Tensor& dweights, bool renormalize, const Tensor& dprob,
                                  Tensor& dlogits);
  // capacity: per expert (E values), or empty: keep every row.
  virtual int64_t moe_permute(const Tensor& experts, int64_t E, std::span<const int64_t> capacity,
                              Tensor& pos, std::vector<int64_t>& counts);
  virtual void moe_permute_order(const Tensor& pos, Tensor& order);
  virtual void moe_dispatch(const Tensor& x, const Tensor& order, int64_t k, Tensor& xs);
  virtual void moe_dispatch_backward(const Tensor& dxs, const Tensor& pos, int64_t k, Tensor& dx,
                                     bool accumulate);
  virtual void moe_combine(const Tensor& ys, const Tensor& weights, const Tensor& pos, Tensor& y);
  virtual void moe_combine_backward(const Tensor& dy, const Tensor& ys, const Tensor& weights,
                                    const Tensor& pos, Tensor& dys, Tensor& dweights);

  // ---- biases and gates (Qwen2-MoE)
  virtual void add_bias(Tensor& y, const Tensor& b);
  virtual void bias_grad(const Tensor& dy, Tensor& db);
  virtual void sigmoid_gate_forward(const Tensor& z, const Tensor& ys, Tensor& y);
  virtual void sigmoid_gate_backward(const Tensor& dy, const Tensor& z, const Tensor& ys,
                                     Tensor& dys, Tensor& dz);

  // ---- loss (dw_overwrite: the first write of the head's gradient)
  // The summed loss written into a.loss.
  virtual void linear_cross_entropy(const LinearCrossEntropy& a, bool dw_overwrite);
  virtual void vocab_shard_lse(const Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                               Tensor& lse, Tensor& target_logit);
  virtual void vocab_shard_combine(const Tensor& lse_all, const Tensor& targets,
                                   const Tensor& target_logit, Tensor& glse, Tensor& loss);
  virtual void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                                   const Tensor& glse, float grad_scale);

 protected:
  // The error of a method this backend has no kernel for.
  [[noreturn]] void missing(const char* op) const;

 private:
  Device device_;
};

// The backend of `device` (cpu; cuda where this loom has the CUDA backend). Other devices, and
// cuda without the backend, are a loom::Error naming `op`.
Backend& backend(const char* op, Device device);

// The CPU's backend (ops/cpu_backend.cpp) and, with the CUDA backend, the GPU's
// (ops/cuda/cuda_backend.cpp): made once, on first use.
Backend& cpu_backend();
#ifdef LOOM_CUDA_BACKEND
Backend& cuda_backend();
#endif

}  // namespace loom::ops
