// The GPU's backend: each op on kernels/cuda (ops/backend.hpp), on the process's compute stream.
// Built only with the CUDA backend (cmake/cuda.cmake). An op without a CUDA kernel yet is the
// Backend's error naming it (the exact attention, the fused loss and GLA are next).
//
// Host data in the op signatures (tokens, positions, the RoPE table) is copied to the device per
// call until the ops take device tensors for them: the tokens of the call, and the RoPE table's
// rows at the call's positions (not the whole table, which is 32 MiB at 131072 positions).
#include <cstring>

#include "core/error.hpp"
#include "kernels/cuda/cast.hpp"
#include "kernels/cuda/embedding.hpp"
#include "kernels/cuda/gemm.hpp"
#include "kernels/cuda/rmsnorm.hpp"
#include "kernels/cuda/rope.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/swiglu.hpp"
#include "ops/backend.hpp"
#include "ops/shape.hpp"

namespace loom::ops {

namespace {

// A device tensor holding n host values of `dt` (queued on the stream: the host buffer may be
// reused once this returns, as cudaMemcpyAsync from pageable memory stages it first).
Tensor upload(const void* host, int64_t n, DType dt) {
  Tensor h = Tensor::empty({n}, dt);
  std::memcpy(h.raw(), host, size_t(n) * dtype_size(dt));
  Tensor d = Tensor::empty({n}, dt, Device::cuda);
  d.copy_from(h);
  return d;
}

// The RoPE table's cos and sin rows at `positions`, on the device, with positions 0..T-1 into
// them. A position outside the table is an error here, as the CPU kernel's.
struct RopeRows {
  Tensor cos, sin, positions;
  cuda::RopeDeviceTable table() const {
    return {cos.data<float>(), sin.data<float>(), 0, rows(cos)};
  }
};
RopeRows rope_rows(const std::vector<int32_t>& positions, const RopeTable& t) {
  const int64_t T = int64_t(positions.size()), half = t.head_dim / 2;
  std::vector<float> c(size_t(T * half)), s(size_t(T * half));
  std::vector<int32_t> idx(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) {
    const int32_t p = positions[size_t(i)];
    LOOM_CHECK(p >= 0 && p < t.num_positions, "rope: position ", p, " outside the table of ",
               t.num_positions, " positions");
    std::memcpy(&c[size_t(i * half)], &t.cos[size_t(p) * size_t(half)], size_t(half) * 4);
    std::memcpy(&s[size_t(i * half)], &t.sin[size_t(p) * size_t(half)], size_t(half) * 4);
    idx[size_t(i)] = int32_t(i);
  }
  RopeRows r{upload(c.data(), T * half, DType::f32), upload(s.data(), T * half, DType::f32),
             upload(idx.data(), T, DType::i32)};
  r.cos = r.cos.view({T, half});
  r.sin = r.sin.view({T, half});
  return r;
}

cuda::GemmArgs gemm_args(cuda::Trans ta, cuda::Trans tb, int64_t M, int64_t N, int64_t K,
                         const Tensor& a, const Tensor& b, DType ab) {
  cuda::GemmArgs g;
  g.ta = ta, g.tb = tb, g.M = M, g.N = N, g.K = K;
  g.A = a.raw(), g.lda = stride(a);
  g.B = b.raw(), g.ldb = stride(b);
  g.ab = ab;
  return g;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() : Backend(Device::cuda) {}

  double timed(const std::function<void()>& fn) override {
    cuda::EventTimer t;
    t.start();
    fn();
    t.stop();
    return t.elapsed_ms() * 1e-3;
  }

  void cast(const Tensor& src, Tensor& dst) override {
    if (src.dtype() == DType::bf16)
      cuda::cast_bf16_to_f32(src.data<bf16>(), f(dst), src.numel());
    else
      cuda::cast_f32_to_bf16(f(src), dst.data<bf16>(), src.numel());
  }
  void add_inplace(Tensor& y, const Tensor& x) override {
    cuda::add_inplace(f(y), f(x), y.numel());
  }
  void fill(Tensor& x, float value) override { cuda::fill(f(x), x.numel(), value); }

  // y [M, N] (+)= x [M, K] w [N, K]^T; a bf16 y is the product rounded.
  void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::N, cuda::Trans::T, rows(x), cols(y), cols(x), x, w, x.dtype());
    g.ldc = stride(y);
    if (y.dtype() == DType::bf16)
      g.C16 = y.data<bf16>();
    else
      g.C = f(y), g.accumulate = accumulate;
    cuda::gemm(g);
  }
  void linear_residual(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::N, cuda::Trans::T, rows(x), cols(y), cols(x), x, w, x.dtype());
    g.C = f(y), g.ldc = stride(y);
    g.R = f(r), g.ldr = stride(r);
    cuda::gemm(g);
  }
  // dx [M, K] = dy [M, N] w [N, K].
  void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::N, cuda::Trans::N, rows(dy), cols(dx), cols(dy), dy, w, dy.dtype());
    g.C = f(dx), g.ldc = stride(dx);
    cuda::gemm(g);
  }
  // dw [N, K] (+)= dy [M, N]^T x [M, K].
  void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool add) override {
    cuda::GemmArgs g =
        gemm_args(cuda::Trans::T, cuda::Trans::N, cols(dy), cols(x), rows(dy), dy, x, dy.dtype());
    g.C = f(dw), g.ldc = stride(dw), g.accumulate = add;
    cuda::gemm(g);
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                       Tensor& rstd) override {
    if (y.dtype() == DType::bf16)
      cuda::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, y.data<bf16>(), f(rstd));
    else
      cuda::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, f(y), f(rstd));
  }
  void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps, Tensor& y,
                                      Tensor& rstd) override {
    cuda::rmsnorm_forward_rounding_input(f(x), x16.data<bf16>(), f(w), rows(x), w.numel(), eps,
                                         y.data<bf16>(), f(rstd));
  }
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dx, Tensor& dw) override {
    if (x.dtype() == DType::bf16)
      cuda::rmsnorm_backward(f(dy), x.data<bf16>(), f(w), f(rstd), rows(x), w.numel(), f(dx),
                             f(dw));
    else
      cuda::rmsnorm_backward(f(dy), f(x), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw));
  }
  void swiglu_forward(const Tensor& gu, Tensor& act) override {
    if (gu.dtype() == DType::bf16)
      cuda::swiglu_forward(gu.data<bf16>(), rows(gu), cols(act), act.data<bf16>());
    else if (act.dtype() == DType::bf16)
      cuda::swiglu_forward(f(gu), rows(gu), cols(act), act.data<bf16>());
    else
      cuda::swiglu_forward(f(gu), rows(gu), cols(act), f(act));
  }
  void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) override {
    if (gu.dtype() == DType::bf16)
      cuda::swiglu_backward(f(dact), gu.data<bf16>(), rows(gu), cols(dact), dgu.data<bf16>());
    else
      cuda::swiglu_backward(f(dact), f(gu), rows(gu), cols(dact), f(dgu));
  }
  void rope(Tensor& x, int64_t B, int64_t H, const std::vector<int32_t>& positions,
            const RopeTable& table, bool backward) override {
    const int64_t T = rows(x) / B, D = x.size(1) / H;
    const RopeRows r = rope_rows(positions, table);
    cuda::RopeDeviceTable t = r.table();
    t.head_dim = table.head_dim;
    if (backward)
      cuda::rope_backward(f(x), B, T, H, D, stride(x), r.positions.data<int32_t>(), t);
    else
      cuda::rope_forward(f(x), B, T, H, D, stride(x), r.positions.data<int32_t>(), t);
  }
  void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc,
                    const std::vector<int32_t>& positions, const RopeTable& table, bool backward,
                    Tensor& out) override {
    const int64_t T = rows(x) / B, D = x.size(1) / (H + Hc);
    const RopeRows r = rope_rows(positions, table);
    cuda::RopeDeviceTable t = r.table();
    t.head_dim = table.head_dim;
    cuda::rope_rounded(f(x), B, T, H, Hc, D, stride(x), r.positions.data<int32_t>(), t, backward,
                       out.data<bf16>(), out.size(1));
  }

  void embedding_forward(const int32_t* tokens, const Tensor& table, int64_t v0,
                         Tensor& out) override {
    const Tensor t = upload(tokens, rows(out), DType::i32);
    if (v0 < 0)
      cuda::embedding_forward(t.data<int32_t>(), rows(out), f(table), rows(table), table.size(1),
                              f(out));
    else
      cuda::embedding_forward_range(t.data<int32_t>(), rows(out), f(table), v0, rows(table),
                                    table.size(1), f(out));
  }
  void embedding_backward(const int32_t* tokens, const Tensor& dout, int64_t v0,
                          Tensor& dtable) override {
    const Tensor t = upload(tokens, rows(dout), DType::i32);
    if (v0 < 0)
      cuda::embedding_backward(t.data<int32_t>(), rows(dout), f(dout), rows(dtable), dtable.size(1),
                               f(dtable));
    else
      cuda::embedding_backward_range(t.data<int32_t>(), rows(dout), f(dout), v0, rows(dtable),
                                     dtable.size(1), f(dtable));
  }
};

}  // namespace

Backend& cuda_backend() {
  static CudaBackend b;
  return b;
}

}  // namespace loom::ops
