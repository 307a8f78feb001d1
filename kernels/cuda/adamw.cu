#include "kernels/cuda/adamw.hpp"

#include <cmath>

#include "kernels/cuda/check.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {

namespace {

constexpr int kThreads = 256;

struct Scalars {
  float gscale, decay, w1, b2, one_minus_b2, step_size, bc2_sqrt, eps;
  bool lerp_from_end;
};

// One element, op by op as the CPU kernel (kernels/cpu/adamw.cpp): the gradient scaled and
// rounded first, torch.lerp's two forms, denom = sqrt(v) / sqrt(bc2) + eps.
__device__ __forceinline__ float update(float& p, float g, float& m, float& v, const Scalars& s) {
  const float gi = __fmul_rn(g, s.gscale);
  const float mi = s.lerp_from_end ? gi - (gi - m) * (1.0f - s.w1) : m + s.w1 * (gi - m);
  const float vi = v * s.b2 + s.one_minus_b2 * gi * gi;
  m = mi;
  v = vi;
  const float denom = sqrtf(vi) / s.bc2_sqrt + s.eps;
  p = p * s.decay - s.step_size * (mi / denom);
  return p;
}

// Four elements a thread with 16-byte accesses where every stream is aligned.
template <bool kBf16>
__global__ void adamw_vec(float4* __restrict p, const float4* __restrict g, float4* __restrict m,
                          float4* __restrict v, uint2* __restrict pb, int64_t n4, Scalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    float4 pi = p[i], mi = m[i], vi = v[i];
    const float4 gi = g[i];
    update(pi.x, gi.x, mi.x, vi.x, s);
    update(pi.y, gi.y, mi.y, vi.y, s);
    update(pi.z, gi.z, mi.z, vi.z, s);
    update(pi.w, gi.w, mi.w, vi.w, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kBf16) pb[i] = make_uint2(pack2(pi.x, pi.y), pack2(pi.z, pi.w));
  }
}
__global__ void adamw_scalar(float* __restrict p, const float* __restrict g, float* __restrict m,
                             float* __restrict v, uint16_t* __restrict pb, int64_t n, Scalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float pi = p[i], mi = m[i], vi = v[i];
    update(pi, g[i], mi, vi, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (pb) pb[i] = f32_to_bf16_bits(pi);
  }
}

unsigned grid_for(int64_t n) {
  const unsigned b = blocks_for(n, kThreads);
  return b < 2048u ? b : 2048u;
}

}  // namespace

void adamw_step(const AdamWArgs& a, float* param, const float* grad, float* m, float* v, int64_t n,
                bf16* param_bf16) {
  // The same argument checks and scalars as cpu::adamw_step (formed in double, rounded once).
  cpu::check_adamw_args(a, n);
  if (n == 0) return;
  const double lr = a.lr, wd = a.weight_decay, b1 = a.beta1, b2 = a.beta2;
  const double bc1 = 1.0 - std::pow(b1, double(a.step));
  const double bc2 = 1.0 - std::pow(b2, double(a.step));
  Scalars s;
  s.gscale = a.grad_scale;
  s.decay = float(1.0 - lr * wd);
  s.w1 = float(1.0 - b1);
  s.lerp_from_end = s.w1 >= 0.5f;
  s.b2 = a.beta2;
  s.one_minus_b2 = float(1.0 - b2);
  s.step_size = float(lr / bc1);
  s.bc2_sqrt = float(std::sqrt(bc2));
  s.eps = a.eps;
  auto* pb = reinterpret_cast<uint16_t*>(param_bf16);
  const bool vec = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) &&
                   (!pb || (reinterpret_cast<uintptr_t>(pb) & 7u) == 0);
  int64_t done = 0;
  if (vec && n >= 4) {
    const int64_t n4 = n / 4;
    auto* p4 = reinterpret_cast<float4*>(param);
    const auto* g4 = reinterpret_cast<const float4*>(grad);
    auto* m4 = reinterpret_cast<float4*>(m);
    auto* v4 = reinterpret_cast<float4*>(v);
    if (pb)
      adamw_vec<true><<<grid_for(n4), kThreads, 0, stream()>>>(p4, g4, m4, v4,
                                                               reinterpret_cast<uint2*>(pb), n4, s);
    else
      adamw_vec<false><<<grid_for(n4), kThreads, 0, stream()>>>(p4, g4, m4, v4, nullptr, n4, s);
    check_launch("adamw_step");
    done = n4 * 4;
  }
  if (done < n) {
    adamw_scalar<<<grid_for(n - done), kThreads, 0, stream()>>>(
        param + done, grad + done, m + done, v + done, pb ? pb + done : nullptr, n - done, s);
    check_launch("adamw_step");
  }
}

}  // namespace loom::cuda
