#include "ops/ops.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>

#include "core/error.hpp"
#include "kernels/cpu/attention_block.hpp"  // tiled_entries: the tiles the attention computes
#include "kernels/cpu/cross_entropy.hpp"    // the loss's chunks, booked on meta
#include "kernels/cuda/scratch.hpp"         // a GPU kernel's scratch, booked on meta (plain C++)
#include "ops/backend.hpp"
#include "ops/op_count.hpp"
#include "ops/shape.hpp"

namespace loom::ops {

namespace {

using Works = std::vector<KernelWork>;

// The sink of the RecordWork alive on this thread (empty: none).
thread_local std::function<void(const KernelWork&)> g_sink;
// The sink of the ProfileOps alive on this thread, and whether an op is being timed.
thread_local ProfileOps::Sink g_profile;
thread_local bool g_timing = false;
thread_local uint64_t g_ops_run = 0;
// ModeledDevice: whether one is alive, the device it models, and (cuda) cuBLASLt's workspace once
// the first GEMM booked it.
thread_local bool g_modeling = false;
thread_local Device g_modeled = Device::cpu;
thread_local Tensor g_modeled_workspace;

void report(const char* op, KernelWork w) {
  if (!*w.op) w.op = op;
  g_sink(w);
}
void report(const char* op, const Works& ws) {
  for (const KernelWork& w : ws) report(op, w);
}

Works as_works(const KernelWork& w) {
  return {w};
}
Works as_works(Works w) {
  return w;
}

// On meta, modeling a GPU: cuBLASLt's workspace, once (kept until the ModeledDevice scope ends).
void book_gemm_workspace() {
  if (g_modeled != Device::cuda || g_modeled_workspace.defined()) return;
  const MemoryUseScope use(Device::meta, MemoryUse::work);
  g_modeled_workspace =
      Tensor::empty({int64_t(cuda::kGemmWorkspaceBytes / 4)}, DType::i32, Device::meta);
}

// Meta books memory only (nothing to compute) and reports `work()` (a KernelWork or Works) to the
// recorder, if any: it is evaluated only then, so a real device pays nothing for the time model.
// Every other device runs `call` on its Backend (ops/backend.hpp), timed for the op profile when
// one is alive.
template <class Work, class Call>
void on(const char* op, Device device, Work&& work, Call&& call) {
  ++g_ops_run;
  if (device == Device::meta) {
    // A GPU's first GEMM (every GEMM op's name has "linear") allocates cuBLASLt's workspace.
    if (std::string_view(op).find("linear") != std::string_view::npos) book_gemm_workspace();
    if (g_sink) report(op, work());
    return;
  }
  Backend& b = backend(op, device);
  if (!g_profile || g_timing) return call(b);
  double s = 0;
  {
    struct Timing {
      Timing() { g_timing = true; }
      ~Timing() { g_timing = false; }
    } timing;
    s = b.timed([&] { call(b); });
  }
  Works ws = as_works(work());
  for (KernelWork& w : ws)
    if (!*w.op) w.op = op;
  g_profile(op, ws, s);
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

}  // namespace

uint64_t ops_run() {
  return g_ops_run;
}

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

ModeledDevice::ModeledDevice(Device device) {
  LOOM_CHECK(!g_modeling, "ModeledDevice: one is already alive on this thread");
  LOOM_CHECK(device == Device::cpu || device == Device::cuda,
             "ModeledDevice: a meta run models cpu or cuda, not ", device_name(device));
  g_modeling = true;
  g_modeled = device;
}
ModeledDevice::~ModeledDevice() {
  g_modeled_workspace = Tensor();
  g_modeled = Device::cpu;
  g_modeling = false;
}
Device modeled_device() {
  return g_modeled;
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
        KernelWork w = streaming(DType::f32, bytes(src) + bytes(dst), src.numel(), 1);
        if (transfer_name(src, dst)) w.link_bytes = std::min(bytes(src), bytes(dst));
        return w;
      },
      [&](Backend& b) { b.cast(src, dst); });
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
      transfer ? transfer : "copy", src.device(),
      [&] {
        KernelWork w = streaming(src.dtype(), 2 * bytes(src), 0, 0);
        if (transfer) w.link_bytes = bytes(src);
        return w;
      },
      // Every device's memory copies through Tensor (its runtime's copy, core/device_memory.hpp).
      [&](Backend&) { dst.view(src.shape()).copy_from(src); });
}

void add_inplace(Tensor& y, const Tensor& x) {
  LOOM_CHECK(y.numel() == x.numel(), "add_inplace: ", x.numel(), " elements into ", y.numel());
  const char* transfer = transfer_name(x, y);
  on(
      transfer ? transfer : "add_inplace", y.device(),
      [&] {
        KernelWork w = streaming(DType::f32, 2 * bytes(y) + bytes(x), y.numel(), 1);
        if (transfer) w.link_bytes = bytes(x);
        return w;
      },
      [&](Backend& b) { b.add_inplace(y, x); });
}

void fill(Tensor& x, float value) {
  on(
      "fill", x.device(), [&] { return streaming(DType::f32, bytes(x), x.numel(), 0); },
      [&](Backend& b) { b.fill(x, value); });
}

void copy_rows(const Tensor& src, Tensor& dst) {
  LOOM_CHECK(rows(src) == rows(dst) && src.size(1) == dst.size(1),
             "copy_rows: ", shape_str(src.shape()), " into ", shape_str(dst.shape()));
  on(
      "copy_rows", src.device(),
      [&] { return streaming(DType::f32, bytes(src) + bytes(dst), src.numel(), 0); },
      [&](Backend& b) { b.copy_rows(src, dst); });
}

void philox_normal(Tensor& x, uint64_t key, int64_t first, float std) {
  on(
      "philox_normal", x.device(),
      // Philox rounds and Box-Muller: tens of integer and float operations per sample.
      [&] { return streaming(DType::f32, bytes(x), x.numel(), 40); },
      [&](Backend& b) { b.philox_normal(x, key, first, std); });
}

void adamw_step(const AdamWStep& a, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                Tensor* mirror) {
  const int64_t n = p.numel();
  LOOM_CHECK(
      g.numel() == n && m.numel() == n && v.numel() == n && (!mirror || mirror->numel() == n),
      "adamw_step: the weights, gradients, moments and mirror must have one size, got ", n, ", ",
      g.numel(), ", ", m.numel(), ", ", v.numel(), mirror ? ", " : "",
      mirror ? std::to_string(mirror->numel()) : "");
  on(
      "adamw_step", p.device(),
      // Five f32 streams (p, m, v read and written, g read) and the bf16 mirror written.
      [&] {
        return streaming(DType::f32, 7 * bytes(p) + (mirror ? bytes(*mirror) : 0.0), double(n), 12);
      },
      [&](Backend& b) { b.adamw_step(a, p, g, m, v, mirror); });
}

namespace {

// On meta, modeling a GPU: the blocks the CUDA kernels allocate per call, allocated and released
// as the call does (kernels/cuda/scratch.hpp).
void book_scratch(Device device, const std::vector<cuda::ScratchBlock>& blocks) {
  if (device != Device::meta || g_modeled != Device::cuda) return;
  std::vector<Tensor> held;
  for (const cuda::ScratchBlock& b : blocks)
    held.push_back(Tensor::empty({b.numel}, b.dtype, Device::meta));
}

}  // namespace

double sum_squares(const Tensor& x) {
  book_scratch(x.device(), cuda::sum_squares_scratch({x.numel()}));
  double s = 0;
  on(
      "sum_squares", x.device(), [&] { return streaming(DType::f32, bytes(x), x.numel(), 2); },
      [&](Backend& b) { s = b.sum_squares(x); });
  return s;
}

std::vector<double> sum_squares_each(std::span<const Tensor> xs) {
  std::vector<double> s(xs.size(), 0.0);
  if (xs.empty()) return s;
  for (const Tensor& x : xs)
    LOOM_CHECK(x.device() == xs[0].device(), "sum_squares_each: tensors on ",
               device_name(xs[0].device()), " and ", device_name(x.device()), " (one device)");
  std::vector<int64_t> numels;
  for (const Tensor& x : xs) numels.push_back(x.numel());
  book_scratch(xs[0].device(), cuda::sum_squares_scratch(numels));
  on(
      "sum_squares", xs[0].device(),
      [&] {
        Works w;
        for (const Tensor& x : xs) w.push_back(streaming(DType::f32, bytes(x), x.numel(), 2));
        return w;
      },
      [&](Backend& b) { b.sum_squares_each(xs, s); });
  return s;
}

void scale_inplace(Tensor& x, float s) {
  on(
      "scale_inplace", x.device(),
      [&] { return streaming(DType::f32, 2 * bytes(x), x.numel(), 1); },
      [&](Backend& b) { b.scale_inplace(x, s); });
}

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  LOOM_CHECK(y.dtype() != DType::bf16 || !accumulate,
             "linear: a bfloat16 output (the product rounded) cannot accumulate");
  on(
      "linear", y.device(),
      [&] { return gemm("linear", x.dtype(), rows(x), cols(y), cols(x), accumulate); },
      [&](Backend& b) { b.linear(x, w, y, accumulate); });
}

void linear(const Tensor& x, const Tensor& w, const Tensor& r, Tensor& y) {
  LOOM_CHECK(y.dtype() == DType::f32 && r.dtype() == DType::f32 && r.numel() == y.numel(),
             "linear: the residual and the output must be float32 of one shape, got ",
             shape_str(r.shape()), " ", dtype_name(r.dtype()), " and ", shape_str(y.shape()), " ",
             dtype_name(y.dtype()));
  on(
      "linear", y.device(),
      [&] { return gemm("linear", x.dtype(), rows(x), cols(y), cols(x), true); },
      [&](Backend& b) { b.linear_residual(x, w, r, y); });
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
      [&] { return gemm("linear_backward_weight", dy.dtype(), N, K, M, add); },
      [&](Backend& b) { b.linear_backward_weight(dy, x, dw, add); });
}
}  // namespace

bool WeightGrad::take_first_write() const {
  if (!first_write()) return false;
  std::fill(unwritten.begin(), unwritten.end(), uint8_t{0});
  return true;
}

namespace {
// dx [M, K] = dy w (overwritten).
void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx) {
  const int64_t M = rows(dy), N = cols(dy), K = cols(dx);
  on(
      "linear_backward", dy.device(),
      [&] { return gemm("linear_backward", dy.dtype(), M, K, N, false); },
      [&](Backend& b) { b.linear_backward_input(dy, w, dx); });
}
}  // namespace

void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const WeightGrad& dw,
                     Tensor& dx) {
  linear_backward_input(dy, w, dx);
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
      [&] { return streaming(DType::f32, bytes(x) + bytes(y) + bytes(rstd), x.numel(), 4); },
      [&](Backend& b) { b.rmsnorm_forward(x, w, eps, y, rstd); });
}

void rmsnorm_forward_rounding_input(Tensor& x, Tensor& x16, const Tensor& w, float eps, Tensor& y,
                                    Tensor& rstd) {
  LOOM_CHECK(x.dtype() == DType::f32 && x16.dtype() == DType::bf16 && y.dtype() == DType::bf16 &&
                 x16.numel() == x.numel() && y.numel() == x.numel(),
             "rmsnorm_forward_rounding_input: expected f32 x, and bf16 x16 and y of its size");
  on(
      "rmsnorm_forward", x.device(),
      [&] {
        return streaming(DType::f32, 2 * bytes(x) + bytes(x16) + bytes(y) + bytes(rstd), x.numel(),
                         4);
      },
      [&](Backend& b) { b.rmsnorm_forward_rounding_input(x, x16, w, eps, y, rstd); });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  book_scratch(x.device(), cuda::rmsnorm_backward_scratch(rows(x), w.numel()));
  on(
      "rmsnorm_backward", x.device(),
      [&] {
        return streaming(DType::f32, bytes(dy) + bytes(x) + bytes(rstd) + bytes(dx), x.numel(), 8);
      },
      [&](Backend& b) { b.rmsnorm_backward(dy, x, w, rstd, dx, dw); });
}

void swiglu_forward(const Tensor& gu, Tensor& act) {
  LOOM_CHECK(gu.dtype() != DType::bf16 || act.dtype() == DType::bf16,
             "swiglu_forward: a bf16 gate/up needs a bf16 act");
  on(
      "swiglu_forward", gu.device(),
      [&] { return streaming(DType::f32, bytes(gu) + bytes(act), act.numel(), 8); },
      [&](Backend& b) { b.swiglu_forward(gu, act); });
}

void swiglu_backward(const Tensor& dact, const Tensor& gu, Tensor& dgu) {
  LOOM_CHECK(gu.dtype() != DType::bf16 || dgu.dtype() == DType::bf16,
             "swiglu_backward: a bf16 gate/up needs a bf16 dgu");
  on(
      "swiglu_backward", gu.device(),
      [&] { return streaming(DType::f32, bytes(dact) + bytes(gu) + bytes(dgu), dact.numel(), 16); },
      [&](Backend& b) { b.swiglu_backward(dact, gu, dgu); });
}

namespace {

// An index array of an op (tokens, targets, positions): int32 (or `dt`) [n] on the op's device.
void check_indices(const char* op, const char* name, const Tensor& t, int64_t n, Device device,
                   DType dt = DType::i32) {
  LOOM_CHECK(t.defined() && t.ndim() == 1 && t.numel() == n && t.dtype() == dt &&
                 t.is_contiguous() && t.device() == device,
             op, ": ", name, " must be a contiguous ", dtype_name(dt), " [", n, "] on ",
             device_name(device), ", got ",
             t.defined() ? str_cat(shape_str(t.shape()), " ", dtype_name(t.dtype()), " on ",
                                   device_name(t.device()))
                         : std::string("undefined"));
}

// A loss op's output: one float64 on the op's device.
void check_loss(const char* op, const Tensor& loss, Device device) {
  check_indices(op, "loss", loss, 1, device, DType::f64);
}

// A rope call's positions and table: one position per token of the sequence, on x's device,
// and on a GPU the table's device copy.
void check_rope(const char* op, const Tensor& x, int64_t B, const Tensor& positions,
                const Rope& table) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, op, ": ", rows(x), " rows are not B = ", B, " sequences");
  check_indices(op, "positions", positions, rows(x) / B, x.device());
  LOOM_CHECK(!computes(x.device()) || x.device() == Device::cpu || table.cos.defined(), op,
             ": the rotary table has no copy on ", device_name(x.device()),
             " (ops::rope_table(..., device))");
}

}  // namespace

void rope_forward(Tensor& x, int64_t B, int64_t H, const Tensor& positions, const Rope& table) {
  check_rope("rope_forward", x, B, positions, table);
  on(
      "rope_forward", x.device(),
      // x read and written, and each token's row of cos and sin (shared by the heads); a pair
      // of elements rotates in 6 flops.
      [&] { return streaming(DType::f32, 2 * bytes(x) + bytes(x) / double(H), x.numel(), 3); },
      [&](Backend& b) { b.rope(x, B, H, positions, table, false); });
}

void rope_backward(Tensor& dx, int64_t B, int64_t H, const Tensor& positions, const Rope& table) {
  check_rope("rope_backward", dx, B, positions, table);
  on(
      "rope_backward", dx.device(),
      // x read and written, and each token's row of cos and sin (shared by the heads); a pair
      // of elements rotates in 6 flops.
      [&] { return streaming(DType::f32, 2 * bytes(dx) + bytes(dx) / double(H), dx.numel(), 3); },
      [&](Backend& b) { b.rope(dx, B, H, positions, table, true); });
}

void rope_rounded(const Tensor& x, int64_t B, int64_t H, int64_t Hc, const Tensor& positions,
                  const Rope& table, bool backward, Tensor& out) {
  LOOM_CHECK(x.dtype() == DType::f32 && out.dtype() == DType::bf16 && out.is_contiguous() &&
                 out.ndim() == 2 && x.ndim() == 2 && out.size(0) == x.size(0) &&
                 out.size(1) == x.size(1),
             "rope_rounded: x ", shape_str(x.shape()), " ", dtype_name(x.dtype()), ", out ",
             shape_str(out.shape()), " ", dtype_name(out.dtype()),
             " (f32 x and a contiguous bf16 out of the same 2-d shape)");
  LOOM_CHECK(H + Hc > 0 && x.size(1) % (H + Hc) == 0, "rope_rounded: ", x.size(1),
             " columns are not ", H, " + ", Hc, " heads");
  check_rope("rope_rounded", x, B, positions, table);
  on(
      backward ? "rope_backward" : "rope_forward", x.device(),
      // x read, out written, each token's row of cos and sin; the rotated pairs take 6 flops.
      [&] {
        const double rotated = bytes(x) * double(H) / double(H + Hc);
        return streaming(DType::f32,
                         bytes(x) + bytes(out) + rotated / double(std::max<int64_t>(H, 1)),
                         x.numel() * double(H) / double(H + Hc), 3);
      },
      [&](Backend& b) { b.rope_rounded(x, B, H, Hc, positions, table, backward, out); });
}

namespace {

// Host values as a tensor of `shape` on `device`: written in place on the CPU, else one
// host-to-device copy (a tensor without data on meta).
template <class T>
Tensor upload(std::span<const T> values, const Shape& shape, DType dt, Device device) {
  Tensor t = Tensor::empty(shape, dt, device);
  if (!holds_data(device) || values.empty()) return t;
  Tensor h = device == Device::cpu ? t : Tensor::empty(shape, dt);
  std::copy(values.begin(), values.end(), h.data<T>());
  if (device != Device::cpu) t.copy_from(h);
  return t;
}

}  // namespace

Rope rope_table(int64_t head_dim, int64_t num_positions, double theta, const RopeScaling& s,
                Device device) {
  const Shape shape{num_positions, head_dim / 2};
  if (!computes(device)) {
    // No kernel reads it there (meta): its size only (the planner builds thousands of models),
    // and the device copy a GPU holds where the meta run models one.
    Rope r;
    r.host.head_dim = head_dim;
    r.host.num_positions = num_positions;
    if (g_modeled == Device::cuda)
      r.cos = Tensor::empty(shape, DType::f32, device),
      r.sin = Tensor::empty(shape, DType::f32, device);
    return r;
  }
  // Computed on the host (in double, as the CPU's kernels want it); a GPU gets a copy once.
  Rope r{cpu::rope_table(head_dim, num_positions, theta, s), Tensor(), Tensor()};
  if (device != Device::cpu) {
    r.cos = upload(std::span<const float>(r.host.cos), shape, DType::f32, device);
    r.sin = upload(std::span<const float>(r.host.sin), shape, DType::f32, device);
  }
  return r;
}

namespace {

template <class I, class Bound>
Tensor checked_indices(std::span<const I> values, Device device, const char* what, Bound lo,
                       Bound hi, DType dt) {
  for (size_t i = 0; i < values.size(); ++i)
    LOOM_CHECK(values[i] >= lo && values[i] < hi, what, " ", values[i], " at index ", i,
               " is outside [", lo, ", ", hi, ")");
  return upload(values, {int64_t(values.size())}, dt, device);
}

}  // namespace

Tensor index_tensor(std::span<const int32_t> values, Device device, const char* what, int64_t lo,
                    int64_t hi) {
  return checked_indices(values, device, what, lo, hi, DType::i32);
}

Tensor index_tensor(std::span<const int64_t> values, Device device, const char* what, int64_t lo,
                    int64_t hi) {
  return checked_indices(values, device, what, lo, hi, DType::i64);
}

void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out) {
  check_indices("embedding_forward", "tokens", tokens, rows(out), out.device());
  book_scratch(out.device(), cuda::embedding_forward_scratch(rows(out)));
  on(
      "embedding_forward", out.device(),
      [&] { return streaming(DType::f32, 2 * bytes(out), 0, 0); },
      [&](Backend& b) { b.embedding_forward(tokens, table, -1, out); });
}

void embedding_backward(const Tensor& tokens, const Tensor& dout, Tensor& dtable) {
  check_indices("embedding_backward", "tokens", tokens, rows(dout), dout.device());
  book_scratch(dout.device(), cuda::embedding_backward_scratch(rows(dout), rows(dtable)));
  on(
      "embedding_backward", dout.device(),
      [&] { return streaming(DType::f32, 3 * bytes(dout), dout.numel(), 1); },
      [&](Backend& b) { b.embedding_backward(tokens, dout, -1, dtable); });
}

void embedding_forward_range(const Tensor& tokens, const Tensor& table, int64_t v0, Tensor& out) {
  check_indices("embedding_forward_range", "tokens", tokens, rows(out), out.device());
  on(
      "embedding_forward_range", out.device(),
      [&] { return streaming(DType::f32, 2 * bytes(out), 0, 0); },
      [&](Backend& b) { b.embedding_forward(tokens, table, v0, out); });
}

void embedding_backward_range(const Tensor& tokens, const Tensor& dout, int64_t v0,
                              Tensor& dtable) {
  check_indices("embedding_backward_range", "tokens", tokens, rows(dout), dout.device());
  book_scratch(dout.device(), cuda::embedding_backward_scratch(rows(dout), rows(dtable)));
  on(
      "embedding_backward_range", dout.device(),
      [&] { return streaming(DType::f32, 3 * bytes(dout), dout.numel(), 1); },
      [&](Backend& b) { b.embedding_backward(tokens, dout, v0, dtable); });
}

namespace {

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

namespace {

// The CUDA attention's per-call scratch for q [B*Tq, Hq*D] against k [B*Tk, ...]: the flash
// kernels' O(T) or the exact kernels' score matrices.
void book_attention_scratch(const Tensor& q, const Tensor& k, int64_t B, int64_t Hq, bool backward,
                            bool out_bf16, bool plain) {
  if (q.device() != Device::meta || g_modeled != Device::cuda) return;
  const int64_t D = q.size(1) / Hq;
  const bool bf16 = q.dtype() == DType::bf16;
  book_scratch(q.device(), cuda::attention_scratch(
                               B, rows(q) / B, rows(k) / B, Hq, D, bf16, backward, out_bf16, plain,
                               cuda::flash_attention_takes(bf16, D, stride(q), stride(k))));
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, int64_t Hq,
                       int64_t Hkv, Tensor& out, Tensor& lse) {
  book_attention_scratch(q, k, B, Hq, false, out.dtype() == DType::bf16, true);
  on(
      "attention_forward", q.device(),
      [&] {
        return attention_work(causal_tiled_entries(rows(q) / B), B, Hq, q.size(1) / Hq,
                              kForwardProducts,
                              bytes(q) + bytes(k) + bytes(v) + bytes(out) + bytes(lse), q.dtype());
      },
      [&](Backend& b) { b.attention_forward(q, k, v, B, Hq, Hkv, out, lse); });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, int64_t B, int64_t Hq, int64_t Hkv,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
  book_attention_scratch(q, k, B, Hq, true, false, true);
  on(
      "attention_backward", q.device(),
      [&] {
        // delta = rowsum(dO * O) is read and written once more.
        const double moved = bytes(q) + bytes(k) + bytes(v) + bytes(out) + bytes(dout) +
                             3 * bytes(lse) + bytes(dq) + bytes(dk) + bytes(dv);
        return attention_work(causal_tiled_entries(rows(q) / B), B, Hq, q.size(1) / Hq,
                              kBackwardProducts, moved, q.dtype());
      },
      [&](Backend& b) { b.attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv); });
}

void attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t Hq,
                      int64_t Hkv, Tensor& out) {
  on(
      "attention_decode", q.device(),
      [&] {
        const int64_t D = q.size(1) / Hq;
        const double moved = bytes(q) + bytes(out) + 2.0 * double(L * Hkv * D) * 4.0;
        return attention_work(double(rows(q) * L), 1, Hq, D, kForwardProducts, moved);
      },
      [&](Backend& b) { b.attention_decode(q, k, v, L, Hq, Hkv, out); });
}

void attention_block_forward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                             const Tensor& v, Tensor& out, Tensor& lse,
                             const std::function<void()>& progress) {
  book_attention_scratch(q, k, s.B, s.Hq, false, false, false);
  on(
      "attention_block_forward", q.device(),
      [&] {
        return attention_work(block_entries(s), s.B, s.Hq, q.size(1) / s.Hq, kForwardProducts,
                              bytes(q) + bytes(k) + bytes(v) + bytes(out) + bytes(lse));
      },
      [&](Backend& b) { b.attention_block_forward(s, q, k, v, out, lse, progress); });
}

void attention_block_backward(const AttentionBlock& s, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& lse, const Tensor& delta,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const std::function<void()>& progress) {
  book_attention_scratch(q, k, s.B, s.Hq, true, false, false);
  on(
      "attention_block_backward", q.device(),
      [&] {
        const double moved = bytes(q) + bytes(k) + bytes(v) + bytes(lse) + bytes(delta) +
                             bytes(dout) + 2 * (bytes(dq) + bytes(dk) + bytes(dv));
        return attention_work(block_entries(s), s.B, s.Hq, q.size(1) / s.Hq, kBackwardProducts,
                              moved);
      },
      [&](Backend& b) {
        b.attention_block_backward(s, q, k, v, lse, delta, dout, dq, dk, dv, progress);
      });
}

void attention_merge(int64_t B, int64_t Hq, Tensor& out, Tensor& lse, const Tensor& out_b,
                     const Tensor& lse_b) {
  on(
      "attention_merge", out.device(),
      [&] {
        return streaming(DType::f32, 2 * (bytes(out) + bytes(lse)) + bytes(out_b) + bytes(lse_b),
                         out.numel(), 3);
      },
      [&](Backend& b) { b.attention_merge(B, Hq, out, lse, out_b, lse_b); });
}

void attention_delta(int64_t B, int64_t Hq, const Tensor& out, const Tensor& dout, Tensor& delta) {
  on(
      "attention_delta", out.device(),
      [&] {
        return streaming(DType::f32, bytes(out) + bytes(dout) + bytes(delta), out.numel(), 2);
      },
      [&](Backend& b) { b.attention_delta(B, Hq, out, dout, delta); });
}

namespace {

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

// The chunked core's scratch on a modeled GPU (kernels/cuda/scratch.hpp).
void book_gla_scratch(const Gla& s, const Tensor& q, const Tensor& v, bool backward) {
  book_scratch(q.device(), cuda::gla_core_scratch(s.B, rows(q) / s.B, s.H, s.Hkv, q.size(1) / s.H,
                                                  v.size(1) / s.Hkv, s.chunk, backward));
}

}  // namespace

void gla_forward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                 const Tensor& h0, Tensor& o, Tensor& ht) {
  check_gla("gla_forward", s, q);
  book_gla_scratch(s, q, v, false);
  on(
      "gla_forward", q.device(),
      [&] {
        const double moved =
            bytes(q) + bytes(k) + bytes(v) + bytes(gk) + bytes(h0) + bytes(o) + bytes(ht);
        return gla_work(s, q, v, moved, false);
      },
      [&](Backend& b) { b.gla_forward(s, q, k, v, gk, h0, o, ht); });
}

void gla_backward(const Gla& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk,
                  const Tensor& h0, const Tensor& dout, const Tensor& dht, Tensor& dq, Tensor& dk,
                  Tensor& dv, Tensor& dgk, Tensor& dh0) {
  check_gla("gla_backward", s, q);
  book_gla_scratch(s, q, v, true);
  on(
      "gla_backward", q.device(),
      [&] {
        const double moved =
            2 * (bytes(q) + bytes(k) + bytes(v) + bytes(gk) + bytes(h0)) + bytes(dout) + bytes(dht);
        return gla_work(s, q, v, moved, true);
      },
      [&](Backend& b) { b.gla_backward(s, q, k, v, gk, h0, dout, dht, dq, dk, dv, dgk, dh0); });
}

void gla_decay_total(const Gla& s, const Tensor& gk, Tensor& decay) {
  LOOM_CHECK(gk.is_contiguous() && decay.numel() == s.B * gk.size(1), "gla_decay_total: gk ",
             shape_str(gk.shape()), " must be contiguous, decay ", shape_str(decay.shape()),
             " must hold B * its columns");
  on(
      "gla_decay_total", gk.device(),
      [&] { return streaming(DType::f32, bytes(gk) + bytes(decay), gk.numel(), 1); },
      [&](Backend& b) { b.gla_decay_total(s, gk, decay); });
}

void gla_state_fold(const Gla& s, const Tensor& decay, const Tensor& E, Tensor& S) {
  LOOM_CHECK(S.ndim() == 4 && E.numel() == S.numel() && S.is_contiguous() && E.is_contiguous(),
             "gla_state_fold: S ", shape_str(S.shape()), " and E ", shape_str(E.shape()),
             " must be contiguous [B, H, K, V]");
  on(
      "gla_state_fold", S.device(),
      [&] { return streaming(DType::f32, 2 * bytes(S) + bytes(E) + bytes(decay), S.numel(), 2); },
      [&](Backend& b) { b.gla_state_fold(s, decay, E, S); });
}

void gla_gate_forward(const Tensor& z, const Tensor& bias, float normalizer, float clamp_min,
                      Tensor& gk) {
  LOOM_CHECK(z.is_contiguous() && gk.is_contiguous() && z.numel() == gk.numel(),
             "gla_gate_forward: z ", shape_str(z.shape()), " and gk ", shape_str(gk.shape()),
             " must be contiguous and the same size");
  on(
      "gla_gate_forward", z.device(),
      [&] { return streaming(DType::f32, bytes(z) + bytes(gk) + bytes(bias), z.numel(), 10); },
      [&](Backend& b) { b.gla_gate_forward(z, bias, normalizer, clamp_min, gk); });
}

void gla_gate_backward(const Tensor& dgk, const Tensor& z, const Tensor& bias, float normalizer,
                       float clamp_min, Tensor& dz, Tensor& dbias) {
  LOOM_CHECK(z.is_contiguous() && dgk.is_contiguous() && dz.is_contiguous() &&
                 z.numel() == dgk.numel() && z.numel() == dz.numel(),
             "gla_gate_backward: z, dgk and dz must be contiguous and the same size, got ",
             shape_str(z.shape()), ", ", shape_str(dgk.shape()), ", ", shape_str(dz.shape()));
  book_scratch(z.device(), cuda::gla_gate_backward_scratch(rows(z), cols(z),
                                                           bias.defined() && dbias.defined()));
  on(
      "gla_gate_backward", z.device(),
      [&] { return streaming(DType::f32, bytes(dgk) + bytes(z) + bytes(dz), z.numel(), 12); },
      [&](Backend& b) { b.gla_gate_backward(dgk, z, bias, normalizer, clamp_min, dz, dbias); });
}

void gated_rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& w, int64_t heads,
                           float eps, Tensor& y, Tensor& rstd) {
  LOOM_CHECK(heads > 0 && x.is_contiguous() && y.is_contiguous() && cols(x) % heads == 0,
             "gated_rmsnorm_forward: x ", shape_str(x.shape()),
             " must be contiguous and split into ", heads, " heads");
  on(
      "gated_rmsnorm_forward", x.device(),
      [&] {
        return streaming(DType::f32, bytes(x) + bytes(g) + bytes(y) + bytes(rstd), x.numel(), 8);
      },
      [&](Backend& b) { b.gated_rmsnorm_forward(x, g, w, heads, eps, y, rstd); });
}

void gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& w,
                            const Tensor& rstd, int64_t heads, Tensor& dx, Tensor& dg, Tensor& dw) {
  LOOM_CHECK(heads > 0 && x.is_contiguous() && dy.is_contiguous() && dx.is_contiguous() &&
                 cols(x) % heads == 0,
             "gated_rmsnorm_backward: x ", shape_str(x.shape()),
             " must be contiguous and split into ", heads, " heads");
  book_scratch(x.device(), cuda::gated_rmsnorm_backward_scratch(rows(x), cols(x) / heads,
                                                                w.defined() && dw.defined()));
  on(
      "gated_rmsnorm_backward", x.device(),
      [&] {
        return streaming(DType::f32, bytes(dy) + bytes(x) + 2 * bytes(g) + bytes(rstd) + bytes(dx),
                         x.numel(), 16);
      },
      [&](Backend& b) { b.gated_rmsnorm_backward(dy, x, g, w, rstd, heads, dx, dg, dw); });
}

void short_conv_forward(const Tensor& x, const Tensor& w, int64_t B, Tensor& y) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, "short_conv_forward: ", rows(x),
             " rows do not split into B ", B, " samples");
  on(
      "short_conv_forward", x.device(),
      [&] {
        const double width = double(w.numel() / x.size(1));
        return streaming(DType::f32, bytes(x) + bytes(y), x.numel(), 2 * width + 4);
      },
      [&](Backend& b) { b.short_conv_forward(x, w, B, y); });
}

void short_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int64_t B, Tensor& dx,
                         Tensor& dw) {
  LOOM_CHECK(B > 0 && rows(x) % B == 0, "short_conv_backward: ", rows(x),
             " rows do not split into B ", B, " samples");
  book_scratch(x.device(),
               cuda::short_conv_backward_scratch(rows(x), x.size(1), w.numel() / x.size(1)));
  on(
      "short_conv_backward", x.device(),
      [&] {
        const double width = double(w.numel() / x.size(1));
        return streaming(DType::f32, bytes(dy) + bytes(x) + bytes(dx), x.numel(), 4 * width + 8);
      },
      [&](Backend& b) { b.short_conv_backward(dy, x, w, B, dx, dw); });
}

// ---- mixture of experts ------------------------------------------------------------------------

namespace {

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return str_cat(shape_str(t.shape()), " ", dtype_name(t.dtype()),
                 t.is_contiguous() ? "" : " (strided)");
}

// `t`, named `name` in the errors of `op`, must be contiguous, of shape `want` (numel only when
// `want` has one dimension: a vector of any shape), of dtype `dt` or `alt`.
void check_tensor(const char* op, const char* name, const Tensor& t, const Shape& want, DType dt,
                  DType alt) {
  const bool shape_ok =
      t.defined() && (want.size() == 1 ? t.numel() == want[0] : t.shape() == want);
  LOOM_CHECK(shape_ok && t.is_contiguous() && (t.dtype() == dt || t.dtype() == alt), op, ": ", name,
             " must be a contiguous ", dtype_name(dt),
             alt != dt ? str_cat(" or ", dtype_name(alt)) : std::string(), " ", shape_str(want),
             ", got ", describe(t));
}
void check_tensor(const char* op, const char* name, const Tensor& t, const Shape& want, DType dt) {
  check_tensor(op, name, t, want, dt, dt);
}
// A matrix of `dt` (or `alt`) whose shape the op reads from it.
void check_matrix(const char* op, const char* name, const Tensor& t, DType dt, DType alt) {
  LOOM_CHECK(
      t.defined() && t.ndim() == 2 && t.is_contiguous() && (t.dtype() == dt || t.dtype() == alt),
      op, ": ", name, " must be a contiguous 2-d ", dtype_name(dt),
      alt != dt ? str_cat(" or ", dtype_name(alt)) : std::string(), " tensor, got ", describe(t));
}
void check_matrix(const char* op, const char* name, const Tensor& t, DType dt) {
  check_matrix(op, name, t, dt, dt);
}
// Every defined tensor on the device of the first.
void check_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Device d = (*ts.begin())->device();
  for (const Tensor* t : ts)
    LOOM_CHECK(!t->defined() || t->device() == d, op, ": tensors on ", device_name(d), " and ",
               device_name(t->device()), " (one device)");
}
void check_k(const char* op, int64_t k, int64_t E) {
  LOOM_CHECK(k >= 1 && k <= E, op, ": k = ", k,
             " experts per token (the columns of experts) must be in [1, E = ", E, "]");
}

}  // namespace

int64_t MoePermutation::rows() const {
  return std::accumulate(counts.begin(), counts.end(), int64_t{0});
}

void moe_route(const Tensor& logits, const Tensor& bias, bool renormalize, Tensor& probs,
               Tensor& experts, Tensor& weights, Tensor& prob_sum) {
  const char* op = "moe_route";
  check_matrix(op, "logits", logits, DType::f32);
  check_matrix(op, "experts", experts, DType::i32);
  const int64_t M = logits.size(0), E = logits.size(1), k = experts.size(1);
  check_k(op, k, E);
  check_tensor(op, "probs", probs, {M, E}, DType::f32);
  check_tensor(op, "experts", experts, {M, k}, DType::i32);
  check_tensor(op, "weights", weights, {M, k}, DType::f32);
  if (bias.defined()) check_tensor(op, "bias", bias, {E}, DType::f32);
  if (prob_sum.defined()) check_tensor(op, "prob_sum", prob_sum, {E}, DType::f32);
  check_device(op, {&logits, &bias, &probs, &experts, &weights, &prob_sum});
  on(
      op, logits.device(),
      // The softmax (an exp and a few flops per logit), k passes of an argmax over the scores,
      // and the column sums, which read probs once more.
      [&] {
        const double moved = bytes(logits) + bytes(probs) + bytes(bias) + bytes(experts) +
                             bytes(weights) +
                             (prob_sum.defined() ? bytes(probs) + 2 * bytes(prob_sum) : 0.0);
        return streaming(DType::f32, moved, double(M * E), 12 + 2 * double(k));
      },
      [&](Backend& b) {
        b.moe_route(logits, bias, renormalize, probs, experts, weights, prob_sum);
      });
}

void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights,
                        const Tensor& dweights, bool renormalize, const Tensor& dprob,
                        Tensor& dlogits) {
  const char* op = "moe_route_backward";
  check_matrix(op, "probs", probs, DType::f32);
  check_matrix(op, "experts", experts, DType::i32);
  const int64_t M = probs.size(0), E = probs.size(1), k = experts.size(1);
  check_k(op, k, E);
  check_tensor(op, "experts", experts, {M, k}, DType::i32);
  check_tensor(op, "weights", weights, {M, k}, DType::f32);
  check_tensor(op, "dweights", dweights, {M, k}, DType::f32);
  check_tensor(op, "dlogits", dlogits, {M, E}, DType::f32);
  if (dprob.defined()) check_tensor(op, "dprob", dprob, {E}, DType::f32);
  check_device(op, {&probs, &experts, &weights, &dweights, &dprob, &dlogits});
  on(
      op, probs.device(),
      [&] {
        const double moved = bytes(probs) + bytes(experts) + bytes(weights) + bytes(dweights) +
                             bytes(dprob) + bytes(dlogits);
        return streaming(DType::f32, moved, double(M * E), 5);
      },
      [&](Backend& b) {
        b.moe_route_backward(probs, experts, weights, dweights, renormalize, dprob, dlogits);
      });
}

MoePermutation moe_permute(const Tensor& experts, int64_t E, int64_t capacity) {
  LOOM_CHECK(capacity >= 0, "moe_permute: capacity must be >= 0 (0: keep every row), got ",
             capacity);
  if (capacity == 0) return moe_permute(experts, E, std::span<const int64_t>());
  const std::vector<int64_t> each(static_cast<size_t>(std::max<int64_t>(E, 0)), capacity);
  return moe_permute(experts, E, each);
}

MoePermutation moe_permute(const Tensor& experts, int64_t E, std::span<const int64_t> capacity) {
  const char* op = "moe_permute";
  check_matrix(op, "experts", experts, DType::i32);
  LOOM_CHECK(E > 0, op, ": the expert count E must be > 0, got ", E);
  LOOM_CHECK(capacity.empty() || int64_t(capacity.size()) == E, op, ": ", capacity.size(),
             " capacities for ", E, " experts (expected one per expert, or none)");
  for (size_t e = 0; e < capacity.size(); ++e)
    LOOM_CHECK(capacity[e] >= 0, op, ": expert ", e, "'s capacity must be >= 0, got ", capacity[e]);
  const int64_t M = experts.size(0), k = experts.size(1), n = M * k;
  check_k(op, k, E);
  const Device device = experts.device();
  MoePermutation p;
  p.pos = Tensor::empty({n}, DType::i32, device);
  if (device == Device::meta) {
    // No expert indices: the balanced case, the rows spread evenly (the first n % E experts one
    // more), each expert's capped by its capacity, the rest dropped.
    p.counts.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const int64_t even = n / E + (e < n % E ? 1 : 0);
      p.counts[size_t(e)] = capacity.empty() ? even : std::min(even, capacity[size_t(e)]);
    }
    p.dropped = n - p.rows();
  }
  book_scratch(device, cuda::moe_permute_scratch(n, E, !capacity.empty()));
  on(
      op, device,
      // experts read twice (count, place), pos written, then read again to scatter order.
      [&] {
        return streaming(DType::f32, 2 * bytes(experts) + 2 * bytes(p.pos) + 4.0 * double(p.rows()),
                         double(n), 2);
      },
      [&](Backend& b) {
        p.dropped = b.moe_permute(experts, E, capacity, p.pos, p.counts);
        p.order = Tensor::empty({p.rows()}, DType::i32, device);
        b.moe_permute_order(p.pos, p.order);
      });
  if (!p.order.defined()) p.order = Tensor::empty({p.rows()}, DType::i32, device);
  return p;
}

void moe_dispatch(const Tensor& x, const Tensor& order, int64_t k, Tensor& xs) {
  const char* op = "moe_dispatch";
  check_matrix(op, "x", x, DType::f32, DType::bf16);
  LOOM_CHECK(k >= 1, op, ": k (experts per token) must be >= 1, got ", k);
  LOOM_CHECK(order.defined() && order.ndim() == 1, op, ": order must be a 1-d int32 tensor, got ",
             describe(order));
  const int64_t N = order.numel();
  check_tensor(op, "order", order, {N}, DType::i32);
  check_tensor(op, "xs", xs, {N, x.size(1)}, x.dtype());
  check_device(op, {&x, &order, &xs});
  on(
      op, x.device(), [&] { return streaming(x.dtype(), 2 * bytes(xs) + bytes(order), 0, 0); },
      [&](Backend& b) { b.moe_dispatch(x, order, k, xs); });
}

void moe_dispatch_backward(const Tensor& dxs, const Tensor& pos, int64_t k, Tensor& dx,
                           bool accumulate) {
  const char* op = "moe_dispatch_backward";
  check_matrix(op, "dxs", dxs, DType::f32);
  check_matrix(op, "dx", dx, DType::f32);
  LOOM_CHECK(k >= 1, op, ": k (experts per token) must be >= 1, got ", k);
  LOOM_CHECK(dx.size(1) == dxs.size(1), op, ": dx ", describe(dx), " and dxs ", describe(dxs),
             " must have one width");
  check_tensor(op, "pos", pos, {dx.size(0) * k}, DType::i32);
  check_device(op, {&dxs, &pos, &dx});
  on(
      op, dx.device(),
      [&] {
        const double moved = bytes(dxs) + bytes(pos) + bytes(dx) * (accumulate ? 2 : 1);
        return streaming(DType::f32, moved, double(dxs.numel()), 1);
      },
      [&](Backend& b) { b.moe_dispatch_backward(dxs, pos, k, dx, accumulate); });
}

void moe_combine(const Tensor& ys, const Tensor& weights, const Tensor& pos, Tensor& y) {
  const char* op = "moe_combine";
  check_matrix(op, "ys", ys, DType::f32, DType::bf16);
  check_matrix(op, "y", y, DType::f32);
  check_matrix(op, "weights", weights, DType::f32);
  const int64_t M = y.size(0), k = weights.size(1);
  check_tensor(op, "weights", weights, {M, k}, DType::f32);
  LOOM_CHECK(ys.size(1) == y.size(1), op, ": ys ", describe(ys), " and y ", describe(y),
             " must have one width");
  check_tensor(op, "pos", pos, {M * k}, DType::i32);
  check_device(op, {&ys, &weights, &pos, &y});
  on(
      op, y.device(),
      [&] {
        const double moved = bytes(ys) + bytes(weights) + bytes(pos) + 2 * bytes(y);
        return streaming(DType::f32, moved, double(ys.numel()), 2);
      },
      [&](Backend& b) { b.moe_combine(ys, weights, pos, y); });
}

void moe_combine_backward(const Tensor& dy, const Tensor& ys, const Tensor& weights,
                          const Tensor& pos, Tensor& dys, Tensor& dweights) {
  const char* op = "moe_combine_backward";
  check_matrix(op, "dy", dy, DType::f32);
  check_matrix(op, "ys", ys, DType::f32, DType::bf16);
  check_matrix(op, "weights", weights, DType::f32);
  const int64_t M = dy.size(0), k = weights.size(1), N = ys.size(0), d = dy.size(1);
  check_tensor(op, "weights", weights, {M, k}, DType::f32);
  check_tensor(op, "ys", ys, {N, d}, DType::f32, DType::bf16);
  check_tensor(op, "pos", pos, {M * k}, DType::i32);
  check_tensor(op, "dys", dys, {N, d}, DType::f32, DType::bf16);
  check_tensor(op, "dweights", dweights, {M, k}, DType::f32);
  check_device(op, {&dy, &ys, &weights, &pos, &dys, &dweights});
  on(
      op, dy.device(),
      // Each kept row: a dot product with dy's row and the scaled copy of it.
      [&] {
        const double moved =
            bytes(dy) + bytes(ys) + bytes(weights) + bytes(pos) + bytes(dys) + bytes(dweights);
        return streaming(DType::f32, moved, double(ys.numel()), 3);
      },
      [&](Backend& b) { b.moe_combine_backward(dy, ys, weights, pos, dys, dweights); });
}

namespace {

// The checks of grouped_linear and its backward: one count per expert matrix, each >= 0, summing
// to the rows of every one of `ts`.
void check_groups(const char* op, std::span<const Tensor> w, std::span<const int64_t> counts,
                  std::initializer_list<std::pair<const char*, const Tensor*>> ts) {
  LOOM_CHECK(w.size() == counts.size(), op, ": ", w.size(), " expert weights for ", counts.size(),
             " counts (one per expert)");
  int64_t total = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    LOOM_CHECK(counts[e] >= 0, op, ": expert ", e, " has a negative row count ", counts[e]);
    total += counts[e];
  }
  const Tensor& x = *ts.begin()->second;
  for (const auto& [name, t] : ts)
    LOOM_CHECK(t->defined() && t->ndim() == 2 && t->size(0) == total, op, ": ", name, " ",
               describe(*t), " must be 2-d with the ", total, " rows the experts' counts sum to");
  for (size_t e = 0; e < w.size(); ++e)
    LOOM_CHECK(counts[e] == 0 || (w[e].defined() && w[e].ndim() == 2 && w[e].size(1) == x.size(1) &&
                                  w[e].dtype() == x.dtype()),
               op, ": expert ", e, "'s weight ", describe(w[e]), " must be 2-d with x's ",
               x.size(1), " columns and dtype ", dtype_name(x.dtype()));
}

}  // namespace

void grouped_linear(const Tensor& x, std::span<const Tensor> w, std::span<const int64_t> counts,
                    Tensor& y) {
  check_groups("grouped_linear", w, counts, {{"x", &x}, {"y", &y}});
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    Tensor ye = y.narrow(0, off, n);
    linear(x.narrow(0, off, n), w[e], ye);
    off += n;
  }
}

void grouped_linear_backward(const Tensor& dy, const Tensor& x, std::span<const Tensor> w,
                             std::span<const int64_t> counts, std::span<const WeightGrad> dw,
                             Tensor& dx) {
  const char* op = "grouped_linear_backward";
  check_groups(op, w, counts, {{"x", &x}, {"dy", &dy}, {"dx", &dx}});
  LOOM_CHECK(dw.size() == counts.size(), op, ": ", dw.size(), " weight gradients for ",
             counts.size(), " experts");
  // Deferred (DeferWeightGrads), dy is copied once, whole, and each expert's weight gradient
  // reads its rows of the copy: a copy per expert would be sized by the routing, and the step's
  // peak would follow it where the meta run's balanced router cannot know it.
  const Tensor dy_kept = g_deferred ? copy_of(dy) : Tensor();
  const Tensor x_kept = g_deferred && g_copy_inputs ? copy_of(x) : x;
  int64_t off = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    Tensor dxe = dx.narrow(0, off, n);
    if (g_deferred) {
      linear_backward_input(dy.narrow(0, off, n), w[e], dxe);
      g_deferred->push_back({dy_kept.narrow(0, off, n), x_kept.narrow(0, off, n), dw[e]});
    } else {
      linear_backward(dy.narrow(0, off, n), x.narrow(0, off, n), w[e], dw[e], dxe);
    }
    off += n;
  }
}

// ---- biases and gates (Qwen2-MoE) --------------------------------------------------------------

namespace {

// A 2-d f32 matrix, contiguous or a strided view with unit column stride and rows that do not
// overlap (a column slice of a fused GEMM's output).
void check_view(const char* op, const char* name, const Tensor& t) {
  LOOM_CHECK(t.defined() && t.ndim() == 2 && t.dtype() == DType::f32 && t.strides()[1] == 1 &&
                 t.strides()[0] >= t.size(1),
             op, ": ", name,
             " must be a 2-d float32 tensor (or a column slice of one: unit column stride), got ",
             describe(t));
}

}  // namespace

void add_bias(Tensor& y, const Tensor& b) {
  const char* op = "add_bias";
  check_view(op, "y", y);
  check_tensor(op, "b", b, {y.size(1)}, DType::f32);
  check_device(op, {&y, &b});
  on(
      op, y.device(),
      [&] { return streaming(DType::f32, 2 * bytes(y) + bytes(b), double(y.numel()), 1); },
      [&](Backend& be) { be.add_bias(y, b); });
}

void bias_grad(const Tensor& dy, Tensor& db) {
  const char* op = "bias_grad";
  check_view(op, "dy", dy);
  check_tensor(op, "db", db, {dy.size(1)}, DType::f32);
  check_device(op, {&dy, &db});
  book_scratch(dy.device(), cuda::bias_grad_scratch(rows(dy), dy.size(1)));
  on(
      op, dy.device(),
      [&] { return streaming(DType::f32, bytes(dy) + 2 * bytes(db), double(dy.numel()), 1); },
      [&](Backend& be) { be.bias_grad(dy, db); });
}

void sigmoid_gate_forward(const Tensor& z, const Tensor& ys, Tensor& y) {
  const char* op = "sigmoid_gate_forward";
  check_matrix(op, "y", y, DType::f32);
  const int64_t M = y.size(0), d = y.size(1);
  check_tensor(op, "ys", ys, {M, d}, DType::f32, DType::bf16);
  check_tensor(op, "z", z, {M, 1}, DType::f32);
  check_device(op, {&y, &ys, &z});
  on(
      op, y.device(),
      // y read and written, ys and z read; a product and a sum per element (the sigmoid per row
      // is lost in the rows' d elements).
      [&] {
        return streaming(DType::f32, bytes(z) + bytes(ys) + 2 * bytes(y), double(y.numel()), 2);
      },
      [&](Backend& be) { be.sigmoid_gate_forward(z, ys, y); });
}

void sigmoid_gate_backward(const Tensor& dy, const Tensor& z, const Tensor& ys, Tensor& dys,
                           Tensor& dz) {
  const char* op = "sigmoid_gate_backward";
  check_matrix(op, "dy", dy, DType::f32);
  const int64_t M = dy.size(0), d = dy.size(1);
  check_tensor(op, "z", z, {M, 1}, DType::f32);
  check_tensor(op, "ys", ys, {M, d}, DType::f32, DType::bf16);
  check_tensor(op, "dys", dys, {M, d}, DType::f32, DType::bf16);
  check_tensor(op, "dz", dz, {M, 1}, DType::f32);
  check_device(op, {&dy, &z, &ys, &dys, &dz});
  on(
      op, dy.device(),
      // Per element: the dot product's multiply-add and the scaled copy.
      [&] {
        const double moved = bytes(dy) + bytes(z) + bytes(ys) + bytes(dys) + bytes(dz);
        return streaming(DType::f32, moved, double(dy.numel()), 3);
      },
      [&](Backend& be) { be.sigmoid_gate_backward(dy, z, ys, dys, dz); });
}

double linear_cross_entropy(const LinearCrossEntropy& a) {
  const bool grad = a.dx.defined() || a.dw.t.defined();
  if (a.x.device() == Device::meta && g_modeled == Device::cuda) {
    // The GPU kernel's one block (no packed copy of w there), held while its GEMMs take the
    // workspace (the first GEMM of the run may be this one's).
    book_gemm_workspace();
    const MemoryUseScope use(Device::meta, MemoryUse::loss);
    book_scratch(Device::meta,
                 cuda::loss_scratch(rows(a.x), a.V, a.x.dtype(), grad, a.chunk_rows, a.grad_rows));
  } else if (a.x.device() == Device::meta && rows(a.x) > 0) {
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
  check_indices("linear_cross_entropy", "targets", a.targets, rows(a.x), a.x.device());
  if (!a.loss.defined()) {
    // Returned: the op writes it into a scalar of its own, read back here.
    LinearCrossEntropy with = a;
    with.loss = Tensor::empty({1}, DType::f64, a.x.device());
    linear_cross_entropy(with);
    return computes(a.x.device()) ? with.loss.on_host().data<double>()[0] : 0.0;
  }
  check_loss("linear_cross_entropy", a.loss, a.x.device());
  // Taken on every device, so that a meta run marks the gradient written as a real one does.
  const bool dw_overwrite = a.dw.t.defined() && a.dw.take_first_write();
  on(
      "linear_cross_entropy", a.x.device(),
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
      },
      [&](Backend& b) { b.linear_cross_entropy(a, dw_overwrite); });
  return 0;
}

void vocab_shard_lse(const Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                     Tensor& lse, Tensor& target_logit) {
  check_indices("vocab_shard_lse", "targets", targets, rows(logits), logits.device());
  on(
      "vocab_shard_lse", logits.device(),
      [&] { return streaming(DType::f32, bytes(logits), logits.numel(), 4); },
      [&](Backend& b) { b.vocab_shard_lse(logits, Vr, targets, v0, lse, target_logit); });
}

void vocab_shard_combine(const Tensor& lse_all, const Tensor& targets, const Tensor& target_logit,
                         Tensor& glse, Tensor& loss) {
  check_indices("vocab_shard_combine", "targets", targets, cols(lse_all), lse_all.device());
  check_loss("vocab_shard_combine", loss, lse_all.device());
  book_scratch(lse_all.device(), cuda::vocab_shard_combine_scratch(cols(lse_all)));
  on(
      "vocab_shard_combine", lse_all.device(),
      [&] { return streaming(DType::f32, bytes(lse_all) + 2 * bytes(glse), lse_all.numel(), 4); },
      [&](Backend& b) { b.vocab_shard_combine(lse_all, targets, target_logit, glse, loss); });
}

void vocab_shard_dlogits(Tensor& logits, int64_t Vr, const Tensor& targets, int64_t v0,
                         const Tensor& glse, float grad_scale) {
  check_indices("vocab_shard_dlogits", "targets", targets, rows(logits), logits.device());
  on(
      "vocab_shard_dlogits", logits.device(),
      [&] { return streaming(DType::f32, 2 * bytes(logits), logits.numel(), 4); },
      [&](Backend& b) { b.vocab_shard_dlogits(logits, Vr, targets, v0, glse, grad_scale); });
}

}  // namespace loom::ops
