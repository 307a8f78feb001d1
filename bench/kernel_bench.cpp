// Times the non-GEMM CPU kernels at the shapes of the two benchmark models (configs/bench-tiny:
// dim 288, ffn 768, 6/6 heads of 48, vocab 4096; configs/bench-small: dim 512, ffn 1376, 8/4
// heads of 64, vocab 8192), with 2048 tokens per step (B=8, T=256). gemm_bench covers the GEMMs
// and the fused linear cross-entropy. The ring_* rows time context-parallel (ring) attention
// blocks at debug-like shapes (B=1, 8/4 heads, T 4096 and 16384, cp 2 and 4) against full
// attention divided by cp (ring_ideal_* rows, ring_ratio lines); one warm-up call each, and the
// large shapes take seconds per call: `kernel_bench ring 3`. A last attention shape has
// Llama's head dim 128 (B8 T256, 4/4 heads). Usage: kernel_bench [FILTER] [REPS]
//   FILTER: run only the kernels whose name contains it (e.g. swiglu, _bwd, adamw).
//   REPS: timed calls per kernel (default 20), after 2 untimed warm-up calls.
// Each row: the median and the fastest call, and the rate of the median call: GB/s for the
// memory-bound kernels, counting the bytes of each array named under "counted" once, twice if
// marked rw (read and written), so the figure is a lower bound of the memory traffic (no
// write-allocate reads, no re-reads); GFLOP/s for attention, counting the products named under
// "counted" on the causal half of the score matrix only. The buffers are reused from call to call,
// so the smaller ones run from cache. On a machine shared with other jobs, a descheduled OpenMP
// thread stalls the whole team for a scheduler time slice; OMP_NUM_THREADS=1 then gives the
// steadier figures.
// The header names the tier the kernels run (LOOM_CPU_ISA caps it, and oneDNN with it) and the
// f32 GEMM peak measured at that tier (cpu::measure_gemm_peak, the fastest call of oneDNN on
// linear-layer shapes, the MFU denominator of `loom bench`); attention rows add their rate as a
// percentage of that peak, for the median call and for the fastest (like the peak itself, the
// fastest call is the figure that a loaded machine disturbs least). On a machine shared with
// other jobs even that is disturbed; the "busy" figures then help: the same GEMM shapes and the
// attention calls timed in process CPU time divided by the threads (the time the threads ran,
// not the time they waited for a core), the peak as the least CPU time of a call, attention as
// the least CPU time of its calls. Peak measurement is skipped
// when no attention row is selected.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.hpp"
#include "kernels/cpu/adamw.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_bf16.hpp"
#include "kernels/cpu/attention_block.hpp"
#include "kernels/cpu/cast.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/gemm.hpp"
#include "kernels/cpu/rmsnorm.hpp"
#include "kernels/cpu/rope.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

constexpr int kWarmup = 2;
constexpr int64_t kB = 8, kT = 256, kRows = kB * kT;

struct Model {
  const char* name;
  int64_t dim, F, layers, Hq, Hkv, vocab;
  int64_t D() const { return dim / Hq; }
  // Parameters of an untied Llama: attention q,k,v,o, MLP gate,up,down, two norms per layer;
  // embedding, output head and final norm.
  int64_t params() const {
    const int64_t attn = 2 * dim * Hq * D() + 2 * dim * Hkv * D();
    return layers * (attn + 3 * dim * F + 2 * dim) + 2 * vocab * dim + dim;
  }
};
constexpr Model kModels[] = {{"tiny", 288, 768, 6, 6, 6, 4096},
                             {"small", 512, 1376, 8, 8, 4, 8192}};

// Random values for large buffers: a block of normal samples repeated (the kernels' speed does
// not depend on the values as long as they are ordinary floats, and sampling tens of millions
// would dominate the run).
std::vector<float> random_floats(int64_t n, uint64_t seed, float scale = 1.0f) {
  const auto block = test::randn(size_t(std::min<int64_t>(n, 1 << 16)), seed, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = block[i % block.size()];
  return v;
}

__attribute__((format(printf, 1, 2))) std::string format(const char* fmt, ...) {
  char buf[128];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

// CPU time of the process, all threads.
double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// The f32 GEMM peak in busy time: the shapes and forms of cpu::measure_gemm_peak, each call's
// process CPU time divided by the threads, the least over `calls` calls of each.
double busy_gemm_peak(int calls) {
  const int64_t M = 2048;
  const std::pair<int64_t, int64_t> nk[] = {{1376, 512}, {512, 1376}, {1024, 512}};
  const size_t n = size_t(M) * 1376;
  std::vector<float> x(n, 0.01f), w(n, -0.02f), dy(n, 0.03f), out(n);
  double best = 0;
  for (auto [N, K] : nk)
    for (int form = 0; form < 3; ++form) {
      double least = 1e30;
      for (int i = 0; i <= calls; ++i) {
        const double c0 = cpu_seconds();
        if (form == 0) cpu::linear_forward(x.data(), w.data(), out.data(), M, N, K, DType::f32);
        if (form == 1)
          cpu::linear_backward_input(dy.data(), w.data(), out.data(), M, N, K, DType::f32, false);
        if (form == 2)
          cpu::linear_backward_weight(dy.data(), x.data(), out.data(), M, N, K, DType::f32);
        if (i > 0) least = std::min(least, (cpu_seconds() - c0) / omp_get_max_threads());
      }
      best = std::max(best, 2.0 * M * N * K / least);
    }
  return best;
}

class Bench {
 public:
  Bench(std::string filter, int reps) : filter_(std::move(filter)), reps_(reps) {}

  // f32 GEMM peak (FLOP/s) of this tier, in wall-clock time and in busy time (see the top);
  // GFLOP/s rows print their share of them when set.
  double peak = 0, busy_peak = 0;

  bool wants(std::initializer_list<const char*> kernels) const {
    return std::any_of(kernels.begin(), kernels.end(), [&](const char* k) { return wants(k); });
  }
  bool wants(const std::string& kernel) const { return kernel.find(filter_) != std::string::npos; }

  // Times f and prints a row; `amount` is bytes (unit "GB/s") or FLOPs (unit "GFLOP/s").
  // Returns the median time in seconds (0 if the kernel was filtered out).
  template <class F>
  double run(const std::string& kernel, const std::string& shape, double amount, const char* unit,
             const char* counted, F&& f) {
    return run(kernel, shape, amount, unit, counted, kWarmup, f);
  }
  template <class F>
  double run(const std::string& kernel, const std::string& shape, double amount, const char* unit,
             const char* counted, int warmup, F&& f) {
    if (!wants(kernel)) return 0;
    for (int i = 0; i < warmup; ++i) f();
    std::vector<double> t(static_cast<size_t>(reps_));
    double busy = 1e30;
    for (double& s : t) {
      const double c0 = cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      f();
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      busy = std::min(busy, (cpu_seconds() - c0) / omp_get_max_threads());
    }
    std::sort(t.begin(), t.end());
    const double median = t[t.size() / 2];
    const double rate = amount / median;
    std::string share;
    if (peak > 0 && std::string(unit) == "GFLOP/s")
      share =
          format(" (%.1f%% of GEMM peak; fastest call %.1f%%; busy %.1f%%)", 100.0 * rate / peak,
                 100.0 * amount / t.front() / peak, 100.0 * amount / busy / busy_peak);
    std::printf("%-18s %-24s %10.3f %10.3f %8.1f %-7s %s%s\n", kernel.c_str(), shape.c_str(),
                median * 1e3, t.front() * 1e3, rate * 1e-9, unit, counted, share.c_str());
    std::fflush(stdout);
    return median;
  }

 private:
  std::string filter_;
  int reps_;
};

constexpr double kF = sizeof(float), kH = sizeof(bf16);

void bench_rmsnorm(Bench& b, const Model& m) {
  if (!b.wants({"rmsnorm_fwd", "rmsnorm_bwd"})) return;
  const int64_t n = kRows * m.dim;
  auto x = random_floats(n, 1), w = random_floats(m.dim, 2, 0.1f), dy = random_floats(n, 3);
  for (float& v : w) v += 1.0f;
  std::vector<float> y(n), rstd(kRows), dx(n, 0.0f), dw(m.dim, 0.0f);
  const auto shape = format("%lldx%lld", (long long)kRows, (long long)m.dim);
  b.run("rmsnorm_fwd", shape, 2 * kF * n, "GB/s", "x, y", [&] {
    cpu::rmsnorm_forward(x.data(), w.data(), kRows, m.dim, 1e-5f, y.data(), rstd.data());
  });
  b.run("rmsnorm_bwd", shape, 4 * kF * n, "GB/s", "dy, x, dx rw", [&] {
    cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), kRows, m.dim, dx.data(),
                          dw.data());
  });
}

void bench_swiglu(Bench& b, const Model& m) {
  if (!b.wants({"swiglu_fwd", "swiglu_bwd", "swiglu_bf16_fwd", "swiglu_bf16_bwd"})) return;
  const int64_t n = kRows * m.F;
  auto gu = random_floats(2 * n, 1, 3.0f), dh = random_floats(n, 2);
  std::vector<float> h(n), dgu(2 * n);
  const auto shape = format("%lldx%lld", (long long)kRows, (long long)m.F);
  b.run("swiglu_fwd", shape, 3 * kF * n, "GB/s", "gu, h",
        [&] { cpu::swiglu_forward(gu.data(), kRows, m.F, h.data()); });
  b.run("swiglu_bwd", shape, 5 * kF * n, "GB/s", "dh, gu, dgu",
        [&] { cpu::swiglu_backward(dh.data(), gu.data(), kRows, m.F, dgu.data()); });
  // Mixed precision: the saved gate/up, the activation and gu's gradient in bf16, dh in f32.
  std::vector<bf16> gu16(2 * n), h16(n), dgu16(2 * n);
  cpu::cast_f32_to_bf16(gu.data(), gu16.data(), 2 * n);
  b.run("swiglu_bf16_fwd", shape, 3 * kH * n, "GB/s", "gu, h",
        [&] { cpu::swiglu_forward(gu16.data(), kRows, m.F, h16.data()); });
  b.run("swiglu_bf16_bwd", shape, (kF + 4 * kH) * n, "GB/s", "dh, gu, dgu",
        [&] { cpu::swiglu_backward(dh.data(), gu16.data(), kRows, m.F, dgu16.data()); });
}

// RoPE on the q and k of an f32 qkv GEMM output: in place and then cast to bf16 (f32 compute and
// cp's path), and rotated as it is rounded (bf16 without cp), forward and backward alike.
void bench_rope(Bench& b, const Model& m) {
  if (!b.wants({"rope_fwd", "rope_cast_fwd", "rope_rounded_fwd"})) return;
  const int64_t D = m.D(), cols = (m.Hq + 2 * m.Hkv) * D, n = kRows * cols;
  const int64_t T = 256, B = kRows / T;
  const auto table = cpu::rope_table(D, T, 10000.0, {});
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = int32_t(t);
  auto qkv = random_floats(n, 1);
  std::vector<bf16> out(n);
  const auto shape = format("%lldx%lld D%lld", (long long)kRows, (long long)cols, (long long)D);
  const double rotated = double(kRows * (m.Hq + m.Hkv) * D);
  b.run("rope_fwd", shape, 2 * kF * rotated, "GB/s", "q k rw", [&] {
    cpu::rope_forward(qkv.data(), B, T, m.Hq, D, cols, pos.data(), table);
    cpu::rope_forward(qkv.data() + m.Hq * D, B, T, m.Hkv, D, cols, pos.data(), table);
  });
  b.run("rope_cast_fwd", shape, 2 * kF * rotated + (kF + 2) * n, "GB/s", "q k rw, qkv, out", [&] {
    cpu::rope_forward(qkv.data(), B, T, m.Hq, D, cols, pos.data(), table);
    cpu::rope_forward(qkv.data() + m.Hq * D, B, T, m.Hkv, D, cols, pos.data(), table);
    cpu::cast_f32_to_bf16(qkv.data(), out.data(), n);
  });
  b.run("rope_rounded_fwd", shape, (kF + 2) * n, "GB/s", "qkv, out", [&] {
    cpu::rope_rounded(qkv.data(), B, T, m.Hq + m.Hkv, m.Hkv, D, cols, pos.data(), table, false,
                      out.data(), cols);
  });
}

void bench_embedding(Bench& b, const Model& m) {
  if (!b.wants({"embedding_fwd", "embedding_bwd"})) return;
  const int64_t n = kRows * m.dim;
  auto table = random_floats(m.vocab * m.dim, 1), dout = random_floats(n, 2);
  const auto tok = test::random_tokens(kRows, m.vocab, 3);
  std::vector<float> out(n), dtable(m.vocab * m.dim, 0.0f);
  const auto shape =
      format("%lld tok, %lldx%lld", (long long)kRows, (long long)m.vocab, (long long)m.dim);
  b.run("embedding_fwd", shape, 2 * kF * n, "GB/s", "rows gathered, out", [&] {
    cpu::embedding_forward(tok.data(), kRows, table.data(), m.vocab, m.dim, out.data());
  });
  b.run("embedding_bwd", shape, 3 * kF * n, "GB/s", "dout, rows rw", [&] {
    cpu::embedding_backward(tok.data(), kRows, dout.data(), m.vocab, m.dim, dtable.data());
  });
}

// Casts at the size of the activations (mixed-precision inputs of the GEMMs), the gradient norm
// and clipping at the size of all parameters (train/optimizer.cpp).
void bench_cast(Bench& b, const Model& m) {
  if (!b.wants(
          {"cast_f32_to_bf16", "cast_bf16_to_f32", "add_inplace", "sum_squares", "scale_inplace"}))
    return;
  const int64_t n = kRows * m.dim, np = m.params();
  auto x = random_floats(n, 1), y = random_floats(n, 2), g = random_floats(np, 3);
  std::vector<bf16> h(n);
  const auto shape = format("n=%lld (%lldx%lld)", (long long)n, (long long)kRows, (long long)m.dim);
  const auto pshape = format("n=%lld (params)", (long long)np);
  b.run("cast_f32_to_bf16", shape, (kF + kH) * n, "GB/s", "in, out",
        [&] { cpu::cast_f32_to_bf16(x.data(), h.data(), n); });
  b.run("cast_bf16_to_f32", shape, (kF + kH) * n, "GB/s", "in, out",
        [&] { cpu::cast_bf16_to_f32(h.data(), y.data(), n); });
  b.run("add_inplace", shape, 3 * kF * n, "GB/s", "x, y rw",
        [&] { cpu::add_inplace(y.data(), x.data(), n); });
  volatile double sink = 0;
  b.run("sum_squares", pshape, kF * np, "GB/s", "x",
        [&] { sink = sink + cpu::sum_squares(g.data(), np); });
  b.run("scale_inplace", pshape, 2 * kF * np, "GB/s", "x rw",
        [&] { cpu::scale_inplace(g.data(), np, 0.999f); });
}

void bench_adamw(Bench& b, const Model& m) {
  if (!b.wants({"adamw", "adamw+bf16"})) return;
  const int64_t n = m.params();
  auto p = random_floats(n, 1), g = random_floats(n, 2, 1e-3f);
  std::vector<float> mo(n, 0.0f), v(n, 0.0f);
  std::vector<bf16> pb(n);
  const cpu::AdamWArgs a{.lr = 1e-4f, .weight_decay = 0.1f};
  const auto shape = format("n=%lld (params)", (long long)n);
  b.run("adamw", shape, 7 * kF * n, "GB/s", "g, p m v rw",
        [&] { cpu::adamw_step(a, p.data(), g.data(), mo.data(), v.data(), n); });
  b.run("adamw+bf16", shape, 7 * kF * n + kH * n, "GB/s", "g, p m v rw, p bf16",
        [&] { cpu::adamw_step(a, p.data(), g.data(), mo.data(), v.data(), n, pb.data()); });
}

// q, k, v in one token-major buffer as the fused qkv GEMM leaves them (the model's layout).
// attention_bf16_* rows: the same shapes with bf16 q, k, v and attention output (the bf16 mixed
// precision path: kernels/cpu/attention_bf16.hpp, vdpbf16ps where the CPU has it), and a line
// with their speedup over the f32 rows.
void bench_attention(Bench& b, const Model& m) {
  if (!b.wants({"attention_fwd", "attention_bwd", "attention_bf16_fwd", "attention_bf16_bwd"}))
    return;
  const int64_t D = m.D(), stride = (m.Hq + 2 * m.Hkv) * D;
  auto qkv = random_floats(kRows * stride, 1), dout = random_floats(kRows * m.Hq * D, 2);
  std::vector<float> dqkv(qkv.size()), out(dout.size()), lse(kB * m.Hq * kT);
  const float *q = qkv.data(), *k = q + m.Hq * D, *v = k + m.Hkv * D;
  float *dq = dqkv.data(), *dk = dq + m.Hq * D, *dv = dk + m.Hkv * D;
  const cpu::AttentionShape s{kB, kT, m.Hq, m.Hkv, D, stride, stride, 1.0f / std::sqrt(float(D))};
  // One T x T x D product over the causal half, per (batch, head).
  const double product = 2.0 * kB * m.Hq * kT * kT * D / 2;
  const auto shape = format("B%lld T%lld H%lld/%lld D%lld", (long long)kB, (long long)kT,
                            (long long)m.Hq, (long long)m.Hkv, (long long)D);
  const double fwd = b.run("attention_fwd", shape, 2 * product, "GFLOP/s", "QK^T, PV",
                           [&] { cpu::attention_forward(s, q, k, v, out.data(), lse.data()); });
  const double bwd = b.run(
      "attention_bwd", shape, 5 * product, "GFLOP/s", "QK^T, dO V^T, P^T dO, dS^T Q, dS K", [&] {
        cpu::attention_backward(s, q, k, v, out.data(), lse.data(), dout.data(), dq, dk, dv);
      });
  std::vector<bf16> qkv16(qkv.size()), out16(out.size());
  for (size_t i = 0; i < qkv.size(); ++i) qkv16[i] = float_to_bf16(qkv[i]);
  const bf16 *q16 = qkv16.data(), *k16 = q16 + m.Hq * D, *v16 = k16 + m.Hkv * D;
  const double fwd16 = b.run("attention_bf16_fwd", shape, 2 * product, "GFLOP/s", "QK^T, PV", [&] {
    cpu::attention_forward_bf16(s, q16, k16, v16, out.data(), lse.data());
  });
  for (size_t i = 0; i < out.size(); ++i) out16[i] = float_to_bf16(out[i]);
  const double bwd16 = b.run("attention_bf16_bwd", shape, 5 * product, "GFLOP/s",
                             "QK^T, dO V^T, P^T dO, dS^T Q, dS K", [&] {
                               cpu::attention_backward_bf16(s, q16, k16, v16, out16.data(),
                                                            lse.data(), dout.data(), dq, dk, dv);
                             });
  if (fwd > 0 && bwd > 0 && fwd16 > 0 && bwd16 > 0)
    std::printf("attention bf16/f32 speedup (median): fwd %.2fx, bwd %.2fx, fwd+bwd %.2fx (%s)\n",
                fwd / fwd16, bwd / bwd16, (fwd + bwd) / (fwd16 + bwd16),
                cpu::attention_bf16_native() ? "vdpbf16ps" : "vdpbf16ps emulated");
}

// Context parallelism (ring attention) at debug-like shapes: what cp rank 0 computes per layer,
// its queries against every rank's key block in ring order (block forward + merge; delta + block
// backward), against the ideal: full causal attention over the whole sequence divided by cp (the
// zigzag layout gives every rank exactly 1/cp of the causal entries). The ratio is the cost of
// cutting the work into blocks (tile pairs straddling chunk boundaries, merges, delta).
void bench_ring(Bench& b) {
  if (!b.wants({"ring_fwd", "ring_bwd", "ring_ideal_fwd", "ring_ideal_bwd"})) return;
  constexpr int64_t B = 1, Hq = 8, Hkv = 4;
  for (int64_t D : {64, 48})
    for (int64_t T : {4096, 16384}) {
      const int64_t stride = (Hq + 2 * Hkv) * D, kvs = 2 * Hkv * D;
      const float scale = 1.0f / std::sqrt(float(D));
      // One T x T x D product over the causal entries, per head.
      const double product = 2.0 * B * Hq * double(T) * double(T + 1) / 2 * D;
      // Ideal: the whole sequence on one rank.
      double idf = 0, idb = 0;
      {
        auto q = random_floats(B * T * stride, 4), o = random_floats(B * T * Hq * D, 5);
        std::vector<float> l(B * Hq * T), dq(q.size()), dout(o.size());
        const float* k = q.data() + Hq * D;
        const float* v = k + Hkv * D;
        const cpu::AttentionShape as{B, T, Hq, Hkv, D, stride, stride, scale};
        const auto shape = format("T%lld D%lld", (long long)T, (long long)D);
        idf = b.run("ring_ideal_fwd", shape, 2 * product, "GFLOP/s", "full T", /*warmup=*/1,
                    [&] { cpu::attention_forward(as, q.data(), k, v, o.data(), l.data()); });
        idb = b.run("ring_ideal_bwd", shape, 5 * product, "GFLOP/s", "full T", /*warmup=*/1, [&] {
          cpu::attention_backward(as, q.data(), k, v, o.data(), l.data(), dout.data(), dq.data(),
                                  dq.data() + Hq * D, dq.data() + (Hq + Hkv) * D);
        });
      }
      for (int64_t cp : {2, 4}) {
        const int64_t n = T / cp;
        const auto shape = format("T%lld cp%lld D%lld", (long long)T, (long long)cp, (long long)D);
        std::vector<std::vector<int64_t>> pos;
        for (int64_t r = 0; r < cp; ++r) pos.push_back(cp_positions(T, cp, r));
        // Every rank's K/V block holds the same values: the timing does not depend on them.
        auto qkv = random_floats(B * n * stride, 1), kv = random_floats(B * n * kvs, 2);
        auto dout = random_floats(B * n * Hq * D, 3);
        std::vector<float> out(dout.size()), lse(B * Hq * n), bo(out.size()), bl(lse.size());
        std::vector<float> delta(lse.size()), dqkv(qkv.size()), dkv(kv.size());
        const float* k = kv.data();
        const float* v = k + Hkv * D;
        const cpu::BlockShape bs{B, n, n, Hq, Hkv, D, stride, kvs, scale};
        const auto fwd = [&] {
          std::fill(out.begin(), out.end(), 0.0f);
          std::fill(lse.begin(), lse.end(), -INFINITY);
          for (int64_t s = 0; s < cp; ++s) {
            cpu::attention_block_forward(bs, qkv.data(), k, v, pos[0].data(), pos[s].data(),
                                         bo.data(), bl.data());
            cpu::attention_merge(B, n, Hq, D, out.data(), lse.data(), bo.data(), bl.data());
          }
        };
        // Rank 0 has 1/cp of the causal entries.
        const double rf = b.run("ring_fwd", shape, 2 * product / double(cp), "GFLOP/s",
                                "rank 0's share", /*warmup=*/1, fwd);
        if (rf == 0) fwd();  // backward needs out and lse
        const double rb =
            b.run("ring_bwd", shape, 5 * product / double(cp), "GFLOP/s", "rank 0's share",
                  /*warmup=*/1, [&] {
                    cpu::attention_delta(B, n, Hq, D, out.data(), dout.data(), delta.data());
                    float* dk = dkv.data();
                    for (int64_t s = 0; s < cp; ++s)
                      cpu::attention_block_backward(bs, qkv.data(), k, v, pos[0].data(),
                                                    pos[s].data(), lse.data(), delta.data(),
                                                    dout.data(), dqkv.data(), dk, dk + Hkv * D);
                  });
        for (const auto& [what, ring, ideal] :
             {std::tuple<const char*, double, double>{"fwd", rf, idf}, {"bwd", rb, idb}})
          if (ring > 0 && ideal > 0)
            std::printf("%-18s %-24s %.2fx ideal (full T / cp = %.3f ms)\n",
                        (std::string("ring_ratio_") + what).c_str(), shape.c_str(),
                        ring / (ideal / double(cp)), ideal / double(cp) * 1e3);
      }
    }
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  if (!(f >> a >> b >> c)) return "unavailable";
  return a + " " + b + " " + c;
}

}  // namespace

int main(int argc, char** argv) {
  std::string filter;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::printf("usage: %s [FILTER] [REPS]\n", argv[0]);
      return 0;
    }
    if (!arg.empty() && arg.find_first_not_of("0123456789") == std::string::npos)
      reps = std::max(1, std::atoi(arg.c_str()));
    else
      filter = arg;
  }
  std::printf(
      "kernel_bench: %d threads, load average %s (1, 5, 15 min), %d timed calls after %d "
      "warm-up\n",
      omp_get_max_threads(), loadavg().c_str(), reps, kWarmup);
  const cpu::CpuIsa& isa = cpu::cpu_isa();
  std::printf("tier: kernels %s, oneDNN %s (LOOM_CPU_ISA=%s); CPU %s\n", cpu::isa_name(isa.kernels),
              isa.onednn.c_str(), isa.requested.c_str(), cpu::cpu_model_name().c_str());
  Bench b(filter, reps);
  if (b.wants({"attention_fwd", "attention_bwd", "attention_bf16_fwd", "attention_bf16_bwd",
               "ring_fwd", "ring_bwd", "ring_ideal_fwd", "ring_ideal_bwd"})) {
    b.peak = cpu::measure_gemm_peak(DType::f32, 1.0);
    b.busy_peak = busy_gemm_peak(10);
    std::printf("f32 GEMM peak at this tier in busy time: %.1f GFLOP/s\n", b.busy_peak * 1e-9);
    std::printf("f32 GEMM peak at this tier: %.1f GFLOP/s (oneDNN %s, %d threads)\n", b.peak * 1e-9,
                isa.onednn.c_str(), omp_get_max_threads());
  }
  std::printf("%-18s %-24s %10s %10s %16s %s\n", "kernel", "shape", "median ms", "min ms",
              "rate (median)", "counted");
  for (const Model& m : kModels) {
    std::printf("-- %s: dim %lld, ffn %lld, heads %lld/%lld, vocab %lld, %.1fM params\n", m.name,
                (long long)m.dim, (long long)m.F, (long long)m.Hq, (long long)m.Hkv,
                (long long)m.vocab, m.params() * 1e-6);
    bench_rmsnorm(b, m);
    bench_swiglu(b, m);
    bench_rope(b, m);
    bench_embedding(b, m);
    bench_cast(b, m);
    bench_adamw(b, m);
    bench_attention(b, m);
  }
  // Attention alone at Llama's head dim 128 (dim 512 in 4 heads, no GQA).
  const Model d128{"d128", 512, 1376, 8, 4, 4, 8192};
  if (b.wants({"attention_fwd", "attention_bwd", "attention_bf16_fwd", "attention_bf16_bwd"}))
    std::printf("-- %s: attention only, heads %lld/%lld of %lld\n", d128.name, (long long)d128.Hq,
                (long long)d128.Hkv, (long long)d128.D());
  bench_attention(b, d128);
  bench_ring(b);
  std::printf("load average at the end: %s\n", loadavg().c_str());
  return 0;
}
