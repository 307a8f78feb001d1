#include "ops/ops.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_bf16.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cpu/attention_decode.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gated_rmsnorm.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/gla.hpp"
#include "kernels/cpu/gla_gate.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/sharded.hpp"
#include "kernels/cpu/short_conv.hpp"
#include "kernels/cpu/swiglu.hpp"

namespace loom::ops {

namespace {

using Works = std::vector<KernelWork>;

// The sink of the RecordWork alive on this thread (empty: none).
thread_local std::function<void(const KernelWork&)> g_sink;
// The sink of the ProfileOps alive on this thread, and whether an op is being timed.
thread_local ProfileOps::Sink g_profile;
thread_local bool g_timing = false;

void report(const char* op, KernelWork w) {
  if (!*w.op) w.op = op;
  g_sink(w);
}
void report(const char* op, const Works& ws) {
  for (const KernelWork& w : ws) report(op, w);
}

// Runs the cpu kernel `fn` on the cpu device; meta books memory only (nothing to compute) and
// reports `work()` (a KernelWork or Works) to the recorder, if any: it is evaluated only then, so
// the cpu path pays nothing for the time model.
Works as_works(const KernelWork& w) {
  return {w};
}
Works as_works(Works w) {
  return w;
}

template <class Fn, class Work>
void on(const char* op, Device device, Fn&& fn, Work&& work) {
  switch (device) {
    case Device::cpu: {
      if (!g_profile || g_timing) return fn();
      double s = 0;
      {
        struct Timing {
          Timing() { g_timing = true; }
          ~Timing() { g_timing = false; }
        } timing;
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      Works ws = as_works(work());
      for (KernelWork& w : ws)
        if (!*w.op) w.op = op;
      g_profile(op, ws, s);
      return;
    }
    case Device::meta:
      if (g_sink) report(op, work());
      return;
    default:
      fail(op, ": no kernel for device ", device_name(device));
  }
}

double bytes(const Tensor& t) {
  return t.defined() ? double(t.numel()) * double(dtype_size(t.dtype())) : 0.0;
}
// A memory-bound op: `moved` bytes read and written, `flops` per element of `elements`.
KernelWork streaming(DType dt, double moved, double elements, double flops_per_element) {
  KernelWork w;
  w.dtype = dt;
  w.bytes = moved;
  w.flops = elements * flops_per_element;
  return w;
}
// C [M, N] (+)= A [M, K] B^T with inputs of `dt` and an f32 C, read too when accumulated.
KernelWork gemm(const char* op, DType dt, int64_t M, int64_t N, int64_t K, bool accumulate) {
  KernelWork w;
  w.op = op;
  w.dtype = dt;
  w.flops = 2.0 * double(M) * double(N) * double(K);
  w.bytes =
      double(M * K + N * K) * double(dtype_size(dt)) + double(M * N) * 4.0 * (accumulate ? 2 : 1);
  w.m = M, w.n = N, w.k = K;
  return w;
}

const float* f(const Tensor& t) {
  return t.data<float>();
}
float* f(Tensor& t) {
  return t.data<float>();
}
int64_t rows(const Tensor& t) {
  return t.size(0);
}
int64_t cols(const Tensor& t) {
  return t.numel() / t.size(0);
}
int64_t stride(const Tensor& t) {
  return t.ndim() > 1 ? t.strides()[0] : t.numel();
}
float scale(int64_t D) {
  return 1.0f / std::sqrt(float(D));
}

}  // namespace

bool computes(Device device) {
  return holds_data(device);
}

RecordWork::RecordWork(std::function<void(const KernelWork&)> sink) {
  LOOM_CHECK(!g_sink, "RecordWork: already recording on this thread");
  LOOM_CHECK(sink, "RecordWork: an empty sink");
  g_sink = std::move(sink);
}
RecordWork::~RecordWork() {
  g_sink = nullptr;
}

ProfileOps::ProfileOps(Sink sink) {
  LOOM_CHECK(!g_profile, "ProfileOps: already profiling on this thread");
  LOOM_CHECK(sink, "ProfileOps: an empty sink");
  g_profile = std::move(sink);
}
ProfileOps::~ProfileOps() {
  g_profile = nullptr;
}

Tensor to_compute(const Tensor& x, DType dt) {
  if (dt == DType::f32) return x;
  Tensor y = Tensor::empty(x.shape(), DType::bf16, x.device());
  cast(x, y);
  return y;
}

Tensor to_f32(const Tensor& x) {
  if (x.dtype() == DType::f32) return x;
  Tensor y = Tensor::empty(x.shape(), DType::f32, x.device());
  cast(x, y);
  return y;
}

namespace {

// The offload transfer a copy between pools is (nullptr: within one pool).
const char* transfer_name(const Tensor& src, const Tensor& dst) {
  if (src.pool() == dst.pool()) return nullptr;
  return src.pool() == Pool::host ? "host_to_device" : "device_to_host";
}

void cast_as(const char* op, const Tensor& src, Tensor& dst) {
  LOOM_CHECK(src.numel() == dst.numel(), op, ": ", src.numel(), " elements into ", dst.numel());
  const bool widen = src.dtype() == DType::bf16;
  LOOM_CHECK(
      dst.dtype() == (widen ? DType::f32 : DType::bf16) && (widen || src.dtype() == DType::f32), op,
      ": f32 to bf16 or bf16 to f32, not ", dtype_name(src.dtype()), " to ",
      dtype_name(dst.dtype()));
  on(
      op, src.device(),
      [&] {
        if (widen)
          cpu::cast_bf16_to_f32(src.data<bf16>(), f(dst), src.numel());
        else
          cpu::cast_f32_to_bf16(f(src), dst.data<bf16>(), src.numel());
      },
      [&] {
        KernelWork w = streaming(DType::f32, bytes(src) + bytes(dst), src.numel(), 1);
        if (transfer_name(src, dst)) w.link_bytes = std::min(bytes(src), bytes(dst));
        return w;
      });
}

}  // namespace

void cast(const Tensor& src, Tensor& dst) {
  cast_as("cast", src, dst);
}

void copy(const Tensor& src, Tensor& dst) {
  const char* transfer = transfer_name(src, dst);
  if (src.dtype() != dst.dtype()) return cast_as(transfer ? transfer : "cast", src, dst);
  LOOM_CHECK(src.numel() == dst.numel() && src.is_contiguous() && dst.is_contiguous(),
             "copy: ", shape_str(src.shape()), " into ", shape_str(dst.shape()),
             " (the same number of elements, both contiguous)");
  on(
      transfer ? transfer : "copy", src.device(), [&] { dst.view(src.shape()).copy_from(src); },
      [&] {
        KernelWork w = streaming(src.dtype(), 2 * bytes(src), 0, 0);
        if (transfer) w.link_bytes = bytes(src);
        return w;
      });
}

void add_inplace(Tensor& y, const Tensor& x) {
  LOOM_CHECK(y.numel() == x.numel(), "add_inplace: ", x.numel(), " elements into ", y.numel());
  const char* transfer = transfer_name(x, y);
  on(
      transfer ? transfer : "add_inplace", y.device(),
      [&] { cpu::add_inplace(f(y), f(x), y.numel()); },
      [&] {
        KernelWork w = streaming(DType::f32, 2 * bytes(y) + bytes(x), y.numel(), 1);
        if (transfer) w.link_bytes = bytes(x);
        return w;
      });
}

void fill(Tensor& x, float value) {
  on(
      "fill", x.device(), [&] { cpu::fill(f(x), x.numel(), value); },
      [&] { return streaming(DType::f32, bytes(x), x.numel(), 0); });
}

void copy_rows(const Tensor& src, Tensor& dst) {
  LOOM_CHECK(rows(src) == rows(dst) && src.size(1) == dst.size(1),
             "copy_rows: ", shape_str(src.shape()), " into ", shape_str(dst.shape()));
  on(
      "copy_rows", src.device(),
      [&] { cpu::copy_rows(f(src), stride(src), f(dst), stride(dst), rows(src), src.size(1)); },
      [&] { return streaming(DType::f32, bytes(src) + bytes(dst), src.numel(), 0); });
}

void philox_normal(Tensor& x, uint64_t key, int64_t first, float std) {
  on(
      "philox_normal", x.device(),
      [&] { loom::philox_normal(key, first, x.numel(), 0.0f, std, f(x)); },
      // Philox rounds and Box-Muller: tens of integer and float operations per sample.
      [&] { return streaming(DType::f32, bytes(x), x.numel(), 40); });
}

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  on(
      "linear", y.device(),
      [&] {
        if (y.dtype() == DType::bf16) {
          LOOM_CHECK(!accumulate, "linear: a bfloat16 output (the product rounded) cannot ",
                     "accumulate");
          cpu::linear_forward_rounded(x.raw(), w.raw(), y.data<bf16>(), rows(x), cols(y), cols(x),
                                      x.dtype());
        } else {
          cpu::linear_forward(x.raw(), w.raw(), f(y), rows(x), cols(y), cols(x), x.dtype(),
                              accumulate);
        }
      },
      [&] { return gemm("linear", x.dtype(), rows(x), cols(y), cols(x), accumulate); });
}

void linear(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y) {
  LOOM_CHECK(y.dtype() == DType::f32 && r.dtype() == DType::f32 && r.numel() == y.numel(),
             "linear: the residual and the output must be float32 of one shape, got ",
             shape_str(r.shape()), " ", dtype_name(r.dtype()), " and ", shape_str(y.shape()), " ",
             dtype_name(y.dtype()));
  on(
      "linear", y.device(),
      [&] {
        cpu::linear_forward_residual(x.raw(), w.raw(), f(r), f(y), rows(x), cols(y), cols(x),
                                     x.dtype());
      },
      [&] { return gemm("linear", x.dtype(), rows(x), cols(y), cols(x), true); });
}

namespace {
thread_local std::vector<DeferredWeightGrad>* g_deferred = nullptr;
thread_local bool g_copy_inputs = false;

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  c.copy_from(t);
  return c;
}
}  // namespace

DeferWeightGrads::DeferWeightGrads(std::vector<DeferredWeightGrad>& into, bool copy_inputs) {
  LOOM_CHECK(!g_deferred, "DeferWeightGrads: already deferring on this thread");
  g_deferred = &into;
  g_copy_inputs = copy_inputs;
}
DeferWeightGrads::~DeferWeightGrads() {
  g_deferred = nullptr;
  g_copy_inputs = false;
}

WeightGradsNow::WeightGradsNow() : deferred_(g_deferred), copy_inputs_(g_copy_inputs) {
  g_deferred = nullptr;
}
WeightGradsNow::~WeightGradsNow() {
  g_deferred = deferred_;
  g_copy_inputs = copy_inputs_;
}

namespace {
// dw [N, K] += dy [M, N]^T x [M, K] (= on dw's first write).
void weight_grad(const Tensor& dy, const Tensor& x, const WeightGrad& g) {
  const int64_t M = rows(dy), N = cols(dy), K = cols(x);
  const bool add = !g.take_first_write();
  Tensor dw = g.t;
  on(
      "linear_backward_weight", dy.device(),
      [&] { cpu::linear_backward_weight(dy.raw(), x.raw(), f(dw), M, N, K, dy.dtype(), add); },
      [&] { return gemm("linear_backward_weight", dy.dtype(), N, K, M, add); });
}
}  // namespace

bool WeightGrad::take_first_write() const {
  if (!first_write()) return false;
  std::fill(unwritten.begin(), unwritten.end(), uint8_t{0});
  return true;
}

void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const WeightGrad& dw,
                     Tensor& dx) {
  const int64_t M = rows(dy), N = cols(dy), K = cols(x);
  on(
      "linear_backward", dy.device(),
      [&] { cpu::linear_backward_input(dy.raw(), w.raw(), f(dx), M, N, K, dy.dtype(), false); },
      [&] { return gemm("linear_backward", dy.dtype(), M, K, N, false); });
  // Deferred on meta too: the copies are booked as a real run holds them, and run_weight_grads
  // reports the weight GEMMs where the schedule runs them.
  if (g_deferred) {
    g_deferred->push_back({copy_of(dy), g_copy_inputs ? copy_of(x) : x, dw});
    return;
  }
  weight_grad(dy, x, dw);
}

void run_weight_grads(std::vector<DeferredWeightGrad>& list) {
  for (DeferredWeightGrad& d : list) weight_grad(d.dy, d.x, d.dw);
  list.clear();
}

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  on(
      "rmsnorm_forward", x.device(),
      [&] {
        if (y.dtype() == DType::bf16)
          cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, y.data<bf16>(), f(rstd));
        else
          cpu::rmsnorm_forward(f(x), f(w), rows(x), w.numel(), eps, f(y), f(rstd));
      },
      [&] { return streaming(DType::f32, bytes(x) + bytes(y) + bytes(rstd), x.numel(), 4); });
}

void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps, Tensor& y,
                                    Tensor& rstd) {
  LOOM_CHECK(x.dtype() == DType::f32 && x16.dtype() == DType::bf16 && y.dtype() == DType::bf16 &&
                 x16.numel() == x.numel() && y.numel() == x.numel(),
             "rmsnorm_forward_rounding_input: expected f32 x, and bf16 x16 and y of its size");
  on(
      "rmsnorm_forward", x.device(),
      [&] {
        cpu::rmsnorm_forward_rounding_input(f(x), x16.data<bf16>(), f(w), rows(x), w.numel(), eps,
                                            y.data<bf16>(), f(rstd));
      },
      [&] {
        return streaming(DType::f32, 2 * bytes(x) + bytes(x16) + bytes(y) + bytes(rstd), x.numel(),
                         4);
      });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  on(
      "rmsnorm_backward", x.device(),
      [&] {
        if (x.dtype() == DType::bf16)
          cpu::rmsnorm_backward(f(dy), x.data<bf16>(), f(w), f(rstd), rows(x), w.numel(), f(dx),
                                f(dw));
        else
          cpu::rmsnorm_backward(f(dy), f(x), f(w), f(rstd), rows(x), w.numel(), f(dx), f(dw));
      },
      [&] {
        return streaming(DType::f32, bytes(dy) + bytes(x) + bytes(rstd) + bytes(dx), x.numel(), 8);
      });
}

void swiglu_forward(const Tensor& gu, Tensor& act) {
  on(
      "swiglu_forward", gu.device(),
      [&] {
        if (gu.dtype() == DType::bf16) {
          LOOM_CHECK(act.dtype() == DType::bf16, "swiglu_forward: a bf16 gate/up needs a bf16 act");
          cpu::swiglu_forward(gu.data<bf16>(), rows(gu), cols(act), act.data<bf16>());
        } else if (act.dtype() == DType::bf16) {
          cpu::swiglu_forward(f(gu), rows(gu), cols(act), act.data<bf16>());
        } else {
          cpu::swiglu_forward(f(gu), rows(gu), cols(act), f(act));
        }
      },
      [&] { return streaming(DType::f32, bytes(gu) + bytes(act), act.numel(), 8); });
}

void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) {
  on(
      "swiglu_backward", gu.device(),
      [&] {
        if (gu.dtype() == DType::bf16) {
          LOOM_CHECK(dgu.dtype() == DType::bf16,
                     "swiglu_backward: a bf16 gate/up needs a bf16 dgu");
          cpu::swiglu_backward(f(dact), gu.data<bf16>(), rows(gu), cols(dact), dgu.data<bf16>());
        } else {
          cpu::swiglu_backward(f(dact), f(gu), rows(gu), cols(dact), f(dgu));
        }
      },
      [&] {
        return streaming(DType::f32, bytes(dact) + bytes(gu) + bytes(dgu), dact.numel(), 16);
      });
}

void rope_forward(Tensor& x, int64_t B, int64_t H, const std::vector<int32_t>& positions,
                  const RopeTable& table) {
  on(
      "rope_forward", x.device(),
      [&] {
        const int64_t T = rows(x) / B;
        cpu::rope_forward(f(x), B, T, H, x.size(1) / H, stride(x), positions.data(), table);
      },
      // x read and written, and each token's row of cos and sin (shared by the heads); a pair
      // of elements rotates in 6 flops.
      [&] { return streaming(DType::f32, 2 * bytes(x) + bytes(x) / double(H), x.numel(), 3); });
}

void rope_backward(Tensor& dx, int64_t B, int64_t H, const std::vector<int32_t>& positions,
                   const RopeTable& table) {
  on(
      "rope_backward", dx.device(),
      [&] {
        const int64_t T = rows(dx) / B;
        cpu::rope_backward(f(dx), B, T, H, dx.size(1) / H, stride(dx), positions.data(), table);
      },
      // x read and written, and each token's row of cos and sin (shared by the heads); a pair
      // of elements rotates in 6 flops.
      [&] { return streaming(DType::f32, 2 * bytes(dx) + bytes(dx) / double(H), dx.numel(), 3); });
}

void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc,
                  const std::vector<int32_t>& positions, const RopeTable& table, bool backward,
                  Tensor& out) {
  LOOM_CHECK(x.dtype() == DType::f32 && out.dtype() == DType::bf16 && out.is_contiguous() &&
                 out.ndim() == 2 && x.ndim() == 2 && out.size(0) == x.size(0) &&
                 out.size(1) == x.size(1),
             "rope_rounded: x ", shape_str(x.shape()), " ", dtype_name(x.dtype()), ", out ",
             shape_str(out.shape()), " ", dtype_name(out.dtype()),
             " (f32 x and a contiguous bf16 out of the same 2-d shape)");
  LOOM_CHECK(H + Hc > 0 && x.size(1) % (H + Hc) == 0, "rope_rounded: ", x.size(1),
             " columns are not ", H, " + ", Hc, " heads");
  on(
      backward ? "rope_backward" : "rope_forward", x.device(),
      [&] {
        const int64_t T = rows(x) / B, D = x.size(1) / (H + Hc);
        cpu::rope_rounded(f(x), B, T, H, Hc, D, stride(x), positions.data(), table, backward,
                          out.data<bf16>(), out.size(1));
      },
      // x read, out written, each token's row of cos and sin; the rotated pairs take 6 flops.
      [&] {
        const double rotated = bytes(x) * double(H) / double(H + Hc);
        return streaming(DType::f32,
                         bytes(x) + bytes(out) + rotated / double(std::max<int64_t>(H, 1)),
                         x.numel() * double(H) / double(H + Hc), 3);
      });
}

RopeTable rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s) {
  // A host table: every backend's rope kernel reads positions' cos/sin from it.
  return cpu::rope_table(head_dim, num_positions, theta, s);
}

void embedding_forward(const int32_t* tokens, const Tensor& table, Tensor& out) {
  on(
      "embedding_forward", out.device(),
      [&] {
        cpu::embedding_forward(tokens, rows(out), f(table), rows(table), table.size(1), f(out));
      },
      [&] { return streaming(DType::f32, 2 * bytes(out), 0, 0); });
}

void embedding_backward(const int32_t* tokens, const Tensor& dout, Tensor& dtable) {
  on(
      "embedding_backward", dout.device(),
      [&] {
        cpu::embedding_backward(tokens, rows(dout), f(dout), rows(dtable), dtable.size(1),
                                f(dtable));
      },
      [&] { return streaming(DType::f32, 3 * bytes(dout), dout.numel(), 1); });
}

void embedding_forward_range(const int32_t* tokens, const Tensor& table, int64_t v0, Tensor& out) {
  on(
      "embedding_forward_range", out.device(),
      [&] {
        cpu::embedding_forward_range(tokens, rows(out), f(table), v0, rows(table), table.size(1),
                                     f(out));
      },
      [&] { return streaming(DType::f32, 2 * bytes(out), 0, 0); });
}

void embedding_backward_range(const int32_t* tokens, const Tensor& dout, int64_t v0,
                              Tensor& dtable) {
  on(
      "embedding_backward_range", dout.device(),
      [&] {
        cpu::embedding_backward_range(tokens, rows(dout), f(dout), v0, rows(dtable), dtable.size(1),
                                      f(dtable));
      },
      [&] { return streaming(DType::f32, 3 * bytes(dout), dout.numel(), 1); });
}

namespace {

cpu::AttentionShape attention_shape(const Tensor& q, const Tensor& k, int64_t B, int64_t Hq,
                                    int64_t Hkv) {
  const int64_t D = q.size(1) / Hq;
  return {B, rows(q) / B, Hq, Hkv, D, stride(q), stride(k), scale(D)};
}

cpu::BlockShape block_shape(const AttentionBlock& s, const Tensor& q, const Tensor& k) {
  const int64_t D = q.size(1) / s.Hq;
  return {s.B,
          int64_t(s.q_pos->size()),
          int64_t(s.k_pos->size()),
          s.Hq,
          s.Hkv,
          D,
          stride(q),
          stride(k),
          scale(D)};
}

// Attention over `entries` (query, key) score entries per sample and head, each costing
// `products` products of length D (2D flops each), moving `moved` bytes. The forward computes
// S = Q K^T and O += P V: 2 products. The backward recomputes S and computes dP = dO V^T,
// dV += P^T dO, dK += dS^T Q and dQ += dS K: 5, 2.5x the forward. (Its split scheme, taken when
// B * Hkv would leave threads idle, recomputes S and dP once more for dq: 7. The fused count is
// kept: it is what flash kernels on other devices do too.)
KernelWork attention_work(double entries, int64_t B, int64_t Hq, int64_t D, double products,
                          double moved, DType dtype = DType::f32) {
  KernelWork w;
  w.dtype = dtype;  // bf16: the products run at the bf16 rate (kernels/cpu/attention_bf16.hpp)
  w.flops = entries * double(B * Hq) * products * 2.0 * double(D);
  w.bytes = moved;
  return w;
}
constexpr double kForwardProducts = 2, kBackwardProducts = 5;

double block_entries(const AttentionBlock& s) {
  return double(cpu::tiled_entries(s.q_pos->data(), int64_t(s.q_pos->size()), s.k_pos->data(),
                                   int64_t(s.k_pos->size())));
}
double causal_tiled_entries(int64_t T) {
  // Pure in T, and asked for by every attention call a plan makes: remembered.
  thread_local std::map<int64_t, double> known;
  if (const auto it = known.find(T); it != known.end()) return it->second;
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::iota(pos.begin(), pos.end(), int64_t(0));
  return known[T] = double(cpu::tiled_entries(pos.data(), T, pos.data(), T));
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                       int64_t Hkv, Tensor& out, Tensor& lse) {
  on(
      "attention_forward", q.device(),
      [&] {
        if (q.dtype() == DType::bf16 && out.dtype() == DType::bf16)
          cpu::attention_forward_bf16(attention_shape(q, k, B, Hq, Hkv), q.data<bf16>(),
                                      k.data<bf16>(), v.data<bf16>(), out.data<bf16>(), f(lse));
        else if (q.dtype() == DType::bf16)
          cpu::attention_forward_bf16(attention_shape(q, k, B, Hq, Hkv), q.data<bf16>(),
                                      k.data<bf16>(), v.data<bf16>(), f(out), f(lse));
        else
          cpu::attention_forward(attention_shape(q, k, B, Hq, Hkv), f(q), f(k), f(v), f(out),
                                 f(lse));
      },
      [&] {
        return attention_work(causal_tiled_entries(rows(q) / B), B, Hq, q.size(1) / Hq,
                              kForwardProducts,
                              bytes(q) + bytes(k) + bytes(v) + bytes(out) + bytes(lse), q.dtype());
      });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
  on(
      "attention_backward", q.device(),
      [&] {
        if (q.dtype() == DType::bf16)
          cpu::attention_backward_bf16(attention_shape(q, k, B, Hq, Hkv), q.data<bf16>(),
                                       k.data<bf16>(), v.data<bf16>(), out.data<bf16>(), f(lse),
                                       f(dout), f(dq), f(dk), f(dv));
        else
          cpu::attention_backward(attention_shape(q, k, B, Hq, Hkv), f(q), f(k), f(v), f(out),
                                  f(lse), f(dout), f(dq), f(dk), f(dv));
      },
      [&] {
        // delta = rowsum(dO * O) is read and written once more.
        const double moved = bytes(q) + bytes(k) + bytes(v) + bytes(out) + bytes(dout) +
                             3 * bytes(lse) + bytes(dq) + bytes(dk) + bytes(dv);
        return attention_work(causal_tiled_entries(rows(q) / B), B, Hq, q.size(1) / Hq,
                              kBackwardProducts, moved, q.dtype());
      });
}

void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                      int64_t Hkv, Tensor& out) {
  on(
      "attention_decode", q.device(),
      [&] {
        const int64_t D = q.size(1) / Hq;
        cpu::DecodeShape s{rows(q), L, Hq, Hkv, D, stride(q), stride(k), scale(D)};
        cpu::attention_decode(s, f(q), f(k), f(v), f(out));
      },
      [&] {
        const int64_t D = q.size(1) / Hq;
        const double moved = bytes(q) + bytes(out) + 2.0 * double(L * Hkv * D) * 4.0;
        return attention_work(double(rows(q) * L), 1, Hq, D, kForwardProducts, moved);
      });
}

void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                             const Tensor& v, Tensor& out, Tensor& lse,
                             const std::function<void()>& progress) {
  on(
      "attention_block_forward", q.device(),
      [&] {
        cpu::attention_block_forward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                     s.k_pos->data(), f(out), f(lse), progress);
      },
      [&] {
        return attention_work(block_entries(s), s.B, s.Hq, q.size(1) / s.Hq, kForwardProducts,
                              bytes(q) + bytes(k) + bytes(v) + bytes(out) + bytes(lse));
      });
}

void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& lse, const Tensor& delta,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const std::function<void()>& progress) {
  on(
      "attention_block_backward", q.device(),
      [&] {
        cpu::attention_block_backward(block_shape(s, q, k), f(q), f(k), f(v), s.q_pos->data(),
                                      s.k_pos->data(), f(lse), f(delta), f(dout), f(dq), f(dk),
                                      f(dv), progress);
      },
      [&] {
        const double moved = bytes(q) + bytes(k) + bytes(v) + bytes(lse) + bytes(delta) +
                             bytes(dout) + 2 * (bytes(dq) + bytes(dk) + bytes(dv));
        return attention_work(block_entries(s), s.B, s.Hq, q.size(1) / s.Hq, kBackwardProducts,
                              moved);
      });
}

void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b) {
  on(
      "attention_merge", out.device(),
      [&] {
        const int64_t T = rows(out) / B;
        cpu::attention_merge(B, T, Hq, out.size(1) / Hq, f(out), f(lse), f(out_b), f(lse_b));
      },
      [&] {
        return streaming(DType::f32, 2 * (bytes(out) + bytes(lse)) + bytes(out_b) + bytes(lse_b),
                         out.numel(), 3);
      });
}

void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout, Tensor& delta) {
  on(
      "attention_delta", out.device(),
      [&] {
        const int64_t T = rows(out) / B;
        cpu::attention_delta(B, T, Hq, out.size(1) / Hq, f(out), f(dout), f(delta));
      },
      [&] {
        return streaming(DType::f32, bytes(out) + bytes(dout) + bytes(delta), out.numel(), 2);
      });
}

namespace {

cpu::GlaCore gla_core(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& gk, const Tensor& h0) {
  cpu::GlaCore a;
  a.B = s.B, a.T = rows(q) / s.B, a.H = s.H, a.Hkv = s.Hkv;
  a.K = q.size(1) / s.H, a.V = v.size(1) / s.Hkv;
  a.scale = scale(a.K);
  a.chunk = s.chunk, a.sub_chunk = s.sub_chunk;
  a.q = {f(q), stride(q)}, a.k = {f(k), stride(k)}, a.v = {f(v), stride(v)};
  a.gk = {f(gk), stride(gk)};
  a.h0 = h0.defined() ? f(h0) : nullptr;
  return a;
}

float* f_or_null(Tensor& t) {
  return t.defined() ? f(t) : nullptr;
}
const float* f_or_null(const Tensor& t) {
  return t.defined() ? f(t) : nullptr;
}

void check_gla(const char* op, const Gla& s, const Tensor& q) {
  LOOM_CHECK(s.B > 0 && s.H > 0 && rows(q) % s.B == 0 && q.size(1) % s.H == 0, op, ": q ",
             shape_str(q.shape()), " does not split into B ", s.B, " samples and H ", s.H,
             " heads");
}

// The flops of the GLA chunk algorithm (kernels/cpu/gla.cpp) per sample and query head, chunk by
// chunk of L tokens: the intra-chunk scores A over the sub-chunk pairs at or below the diagonal
// (whole off-diagonal pairs, the triangle of diagonal ones) cost 2K per entry and A V 2V; each
// token's inter-chunk products with the state (q S, the update k^T v, ...) cost 2KV. Forward: A,
// A V, q S and the update. Backward: the states' forward sweep, A again, dA = dO V^T,
// dv = A^T dO and dq, dk within the chunk (3 products of K and 2 of V per entry), then dv, dq, dk
// against the state and the dS update (5 per token with the sweep).
double gla_flops(const Gla& s, int64_t T, int64_t K, int64_t V, bool backward) {
  double total = 0;
  for (int64_t t0 = 0; t0 < T; t0 += s.chunk) {
    const int64_t L = std::min(s.chunk, T - t0), c = std::min(s.sub_chunk, L);
    const double n = double((L + c - 1) / c);
    const double entries = double(c * c) * n * (n - 1) / 2 + n * double(c * (c + 1)) / 2;
    const double kv = double(L * K * V);
    total += backward ? entries * double(6 * K + 4 * V) + 10 * kv
                      : entries * double(2 * K + 2 * V) + 4 * kv;
  }
  return total * double(s.B * s.H);
}

KernelWork gla_work(const Gla& s, const Tensor& q, const Tensor& v, double moved, bool backward) {
  KernelWork w;
  w.dtype = DType::f32;
  w.flops = gla_flops(s, rows(q) / s.B, q.size(1) / s.H, v.size(1) / s.Hkv, backward);
  w.bytes = moved;
  return w;
}

}  // namespace

void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                 const Tensor& h0, Tensor& o, Tensor& ht) {
  check_gla("gla_forward", s, q);
  on(
      "gla_forward", q.device(),
      [&] {
        cpu::gla_forward(gla_core(s, q, k, v, gk, h0), {f(o), stride(o)}, f_or_null(ht));
      },
      [&] {
        const double moved =
            bytes(q) + bytes(k) + bytes(v) + bytes(gk) + bytes(h0) + bytes(o) + bytes(ht);
        return gla_work(s, q, v, moved, false);
      });
}

void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                  const Tensor& h0, const Tensor& dout, const Tensor& dht, Tensor& dq, Tensor& dk,
                  Tensor& dv, Tensor& dgk, Tensor& dh0) {
  check_gla("gla_backward", s, q);
  on(
      "gla_backward", q.device(),
      [&] {
        cpu::GlaCoreGrads g{{f(dq), stride(dq)},
                            {f(dk), stride(dk)},
                            {f(dv), stride(dv)},
                            {f(dgk), stride(dgk)},
                            f_or_null(dh0)};
        cpu::gla_backward(gla_core(s, q, k, v, gk, h0), {f(dout), stride(dout)}, f_or_null(dht), g);
      },
      [&] {
        const double moved =
            2 * (bytes(q) + bytes(k) + bytes(v) + bytes(gk) + bytes(h0)) + bytes(dout) + bytes(dht);
        return gla_work(s, q, v, moved, true);
      });
}

void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay) {
  LOOM_CHECK(gk.is_contiguous() && decay.numel() == s.B * gk.size(1), "gla_decay_total: gk ",
             shape_str(gk.shape()), " must be contiguous, decay ", shape_str(decay.shape()),
             " must hold B * its columns");
  on(
      "gla_decay_total", gk.device(),
      [&] {
        cpu::gla_decay_total(s.B, rows(gk) / s.B, s.Hkv, gk.size(1) / s.Hkv, f(gk), f(decay));
      },
      [&] { return streaming(DType::f32, bytes(gk) + bytes(decay), gk.numel(), 1); });
}

void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S) {
  LOOM_CHECK(S.ndim() == 4 && E.numel() == S.numel() && S.is_contiguous() && E.is_contiguous(),
             "gla_state_fold: S ", shape_str(S.shape()), " and E ", shape_str(E.shape()),
             " must be contiguous [B, H, K, V]");
  on(
      "gla_state_fold", S.device(),
      [&] { cpu::gla_state_fold(s.B, s.H, s.Hkv, S.size(2), S.size(3), f(decay), f(E), f(S)); },
      [&] { return streaming(DType::f32, 2 * bytes(S) + bytes(E) + bytes(decay), S.numel(), 2); });
}

void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer, float clamp_min,
                      Tensor& gk) {
  LOOM_CHECK(z.is_contiguous() && gk.is_contiguous() && z.numel() == gk.numel(),
             "gla_gate_forward: z ", shape_str(z.shape()), " and gk ", shape_str(gk.shape()),
             " must be contiguous and the same size");
  on(
      "gla_gate_forward", z.device(),
      [&] {
        cpu::gla_gate_forward(f(z), f_or_null(bias), rows(z), cols(z), normalizer, clamp_min,
                              f(gk));
      },
      [&] { return streaming(DType::f32, bytes(z) + bytes(gk) + bytes(bias), z.numel(), 10); });
}

void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias, float normalizer,
                       float clamp_min, Tensor& dz, Tensor& dbias) {
  LOOM_CHECK(z.is_contiguous() && dgk.is_contiguous() && dz.is_contiguous() &&
                 z.numel() == dgk.numel() && z.numel() == dz.numel(),
             "gla_gate_backward: z, dgk and dz must be contiguous and the same size, got ",
             shape_str(z.shape()), ", ", shape_str(dgk.shape()), ", ", shape_str(dz.shape()));
  on(
      "gla_gate_backward", z.device(),
      [&] {
        cpu::gla_gate_backward(f(dgk), f(z), f_or_null(bias), rows(z), cols(z), normalizer,
                               clamp_min, f(dz), bias.defined() ? f(dbias) : nullptr);
      },
      [&] { return streaming(DType::f32, bytes(dgk) + bytes(z) + bytes(dz), z.numel(), 12); });
}

void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w, int64_t heads,
                           float eps, Tensor& y, Tensor& rstd) {
  LOOM_CHECK(heads > 0 && x.is_contiguous() && y.is_contiguous() && cols(x) % heads == 0,
             "gated_rmsnorm_forward: x ", shape_str(x.shape()),
             " must be contiguous and split into ", heads, " heads");
  on(
      "gated_rmsnorm_forward", x.device(),
      [&] {
        const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, eps};
        cpu::gated_rmsnorm_forward(s, f(x), f_or_null(g), g.defined() ? stride(g) : 0, f_or_null(w),
                                   f(y), f(rstd));
      },
      [&] {
        return streaming(DType::f32, bytes(x) + bytes(g) + bytes(y) + bytes(rstd), x.numel(), 8);
      });
}

void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& w,
                            const Tensor& rstd, int64_t heads, Tensor& dx, Tensor& dg, Tensor& dw) {
  LOOM_CHECK(heads > 0 && x.is_contiguous() && dy.is_contiguous() && dx.is_contiguous() &&
                 cols(x) % heads == 0,
             "gated_rmsnorm_backward: x ", shape_str(x.shape()),
             " must be contiguous and split into ", heads, " heads");
  on(
      "gated_rmsnorm_backward", x.device(),
      [&] {
        const cpu::GatedRmsNorm s{rows(x), heads, cols(x) / heads, 0.0f};  // eps is in rstd
        cpu::gated_rmsnorm_backward(s, f(dy), f(x), f_or_null(g), g.defined() ? stride(g) : 0,
                                    f_or_null(w), f(rstd), f(dx), g.defined() ? f(dg) : nullptr,
                                    g.defined() ? stride(dg) : 0, w.defined() ? f(dw) : nullptr);
      },
      [&] {
        return streaming(DType::f32, bytes(dy) + bytes(x) + 2 * bytes(g) + bytes(rstd) + bytes(dx),
                         x.numel(), 16);
      });
}

void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, "short_conv_forward: ", rows(x),
             " rows do not split into B ", B, " samples");
  on(
      "short_conv_forward", x.device(),
      [&] {
        const int64_t C = x.size(1);
        const cpu::ShortConv s{B, rows(x) / B, C, w.numel() / C};
        cpu::short_conv_forward(s, f(x), stride(x), f(w), f(y), stride(y));
      },
      [&] {
        const double width = double(w.numel() / x.size(1));
        return streaming(DType::f32, bytes(x) + bytes(y), x.numel(), 2 * width + 4);
      });
}

void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B, Tensor& dx,
                         Tensor& dw) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, "short_conv_backward: ", rows(x),
             " rows do not split into B ", B, " samples");
  on(
      "short_conv_backward", x.device(),
      [&] {
        const int64_t C = x.size(1);
        const cpu::ShortConv s{B, rows(x) / B, C, w.numel() / C};
        cpu::short_conv_backward(s, f(dy), stride(dy), f(x), stride(x), f(w), f(dx), stride(dx),
                                 f(dw));
      },
      [&] {
        const double width = double(w.numel() / x.size(1));
        return streaming(DType::f32, bytes(dy) + bytes(x) + bytes(dx), x.numel(), 4 * width + 8);
      });
}

size_t linear_cross_entropy_scratch_bytes(int64_t N, int64_t D, int64_t V, DType ab,
                                          int64_t chunk_rows, int64_t grad_rows, bool grad) {
  if (N == 0) return 0;
  const bool grad16 = ab == DType::bf16 && grad;
  const cpu::LinearCrossEntropyChunks ch =
      cpu::linear_cross_entropy_chunks(N, V, chunk_rows, grad16 ? grad_rows : 0);
  return size_t(ch.rows) * size_t(V) * 4 + (grad16 ? size_t(ch.grad_rows) * size_t(V) * 2 : 0) +
         cpu::linear_cross_entropy_packed_bytes(N, D, V, ab, ch, grad16);
}

double linear_cross_entropy(const LinearCrossEntropy& a) {
  if (a.x.device() == Device::meta && rows(a.x) > 0) {
    // The kernel's scratch, alive for the call (the real run's allocator counts it): one chunk of
    // logits and gradients, and the packed head weight.
    const bool grad16 = a.x.dtype() == DType::bf16 && (a.dx.defined() || a.dw.t.defined());
    const cpu::LinearCrossEntropyChunks ch =
        cpu::linear_cross_entropy_chunks(rows(a.x), a.V, a.chunk_rows, grad16 ? a.grad_rows : 0);
    const MemoryUseScope use(Device::meta, MemoryUse::loss);
    Tensor logits = Tensor::empty({ch.rows, a.V}, DType::f32, Device::meta);
    Tensor g16 = grad16 ? Tensor::empty({ch.grad_rows, a.V}, DType::bf16, Device::meta) : Tensor();
    const size_t packed = cpu::linear_cross_entropy_packed_bytes(rows(a.x), a.x.size(1), a.V,
                                                                 a.x.dtype(), ch, grad16);
    const size_t esz = dtype_size(a.x.dtype());
    Tensor w_packed =
        packed > 0 ? Tensor::empty({int64_t((packed + esz - 1) / esz)}, a.x.dtype(), Device::meta)
                   : Tensor();
  }
  double loss = 0;
  // Taken on every device, so that a meta run marks the gradient written as a real one does.
  const bool dw_overwrite = a.dw.t.defined() && a.dw.take_first_write();
  on(
      "linear_cross_entropy", a.x.device(),
      [&] {
        cpu::LinearCrossEntropyArgs ce;
        ce.x = a.x.raw();
        ce.w = a.w.raw();
        ce.ab = a.x.dtype();
        ce.targets = a.targets;
        ce.N = rows(a.x);
        ce.D = cols(a.x);
        ce.V = a.V;
        ce.grad_scale = a.grad_scale;
        ce.dx = a.dx.defined() ? a.dx.data<float>() : nullptr;
        ce.dw = a.dw.t.defined() ? a.dw.t.data<float>() : nullptr;
        ce.dw_overwrite = dw_overwrite;
        ce.chunk_rows = a.chunk_rows;
        ce.grad_rows = a.grad_rows;
        loss = cpu::linear_cross_entropy(ce);
      },
      [&] {
        // The logits GEMM, the softmax over its chunk of logits (written, read, and dlogits
        // written), then the backward GEMMs into dx and dw.
        const char* op = "linear_cross_entropy";
        const int64_t N = rows(a.x), D = cols(a.x);
        const DType dt = a.x.dtype();
        Works w{gemm(op, dt, N, a.V, D, false),
                streaming(DType::f32, 3.0 * double(N * a.V) * 4.0, double(N * a.V), 5)};
        if (a.dx.defined()) w.push_back(gemm(op, dt, N, D, a.V, false));
        if (a.dw.t.defined()) w.push_back(gemm(op, dt, a.V, D, N, !dw_overwrite));
        return w;
      });
  return loss;
}

void vocab_shard_lse(const Tensor& logits, int64_t Vr, const int32_t* targets, int64_t v0,
                     Tensor& lse, Tensor& target_logit) {
  on(
      "vocab_shard_lse", logits.device(),
      [&] {
        cpu::vocab_shard_lse(f(logits), rows(logits), cols(logits), Vr, targets, v0, f(lse),
                             f(target_logit));
      },
      [&] { return streaming(DType::f32, bytes(logits), logits.numel(), 4); });
}

double vocab_shard_combine(const Tensor& lse_all, const int32_t* targets,
                           const Tensor& target_logit, Tensor& glse) {
  double loss = 0;
  on(
      "vocab_shard_combine", lse_all.device(),
      [&] {
        loss = cpu::vocab_shard_combine(f(lse_all), int(rows(lse_all)), cols(lse_all), targets,
                                        f(target_logit), f(glse));
      },
      [&] { return streaming(DType::f32, bytes(lse_all) + 2 * bytes(glse), lse_all.numel(), 4); });
  return loss;
}

void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const int32_t* targets, int64_t v0,
                         const Tensor& glse, float grad_scale) {
  on(
      "vocab_shard_dlogits", logits.device(),
      [&] {
        cpu::vocab_shard_dlogits(f(logits), rows(logits), cols(logits), Vr, targets, v0, f(glse),
                                 grad_scale);
      },
      [&] { return streaming(DType::f32, 2 * bytes(logits), logits.numel(), 4); });
}

}  // namespace loom::ops
