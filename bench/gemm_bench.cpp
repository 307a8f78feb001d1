// GFLOP/s of the oneDNN GEMMs at the linear-layer shapes of the target models (tokens M=2048), in
// the three forms the model uses, f32 and bf16; the per-call overhead on tiny shapes; the MFU
// peak; and the fused linear cross-entropy at N=2048, D=512, V=8192 for several chunk sizes.
// Usage: gemm_bench [seconds_per_case=0.2] [f32|bf16|both] [gemm] [small] [peak] [ce] [alt]
//   The words pick sections (default: gemm small peak). `alt` adds to the gemm table the bf16
//   weight-gradient form done as an explicit transpose of dy into a scratch buffer followed by a
//   plain (non-transposed) GEMM.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include <omp.h>

#include "core/dtype.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/gemm.hpp"

using namespace loom;
using namespace loom::cpu;
using Clock = std::chrono::steady_clock;

namespace {

struct Timing {
  double best, median;  // wall seconds per call
  double cpu;           // process CPU seconds per call (all threads), fastest batch
};

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// With other processes on the cores, wall time only ever grows, so the fastest call is the
// measure of the code; process CPU time also ignores the time spent descheduled, which makes it
// the robust measure with OMP_NUM_THREADS=1 (with more threads it also counts barrier spinning).
template <class F>
Timing time_call(F&& f, double seconds, int batch = 1) {
  f();  // builds the primitive
  std::vector<double> t;
  double spent = 0, cpu = 1e30;
  do {
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i) f();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    cpu = std::min(cpu, (cpu_seconds() - c0) / batch);
    t.push_back(dt / batch);
    spent += dt;
  } while (spent < seconds || t.size() < 3);
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2], cpu};
}

std::vector<char> filled(size_t n, DType t, int seed) {
  std::vector<char> v(n * dtype_size(t));
  for (size_t i = 0; i < n; ++i) {
    const float f = 0.01f * static_cast<float>(static_cast<int>((i * 7 + seed) % 23) - 11);
    if (t == DType::bf16) {
      const bf16 b = float_to_bf16(f);
      std::memcpy(&v[i * 2], &b, 2);
    } else {
      std::memcpy(&v[i * 4], &f, 4);
    }
  }
  return v;
}

// out[c, r] = in[r, c] for a rows x cols bf16 matrix, in 32x32 tiles.
void transpose_bf16(const bf16* in, bf16* out, int64_t rows, int64_t cols) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r0 = 0; r0 < rows; r0 += 32)
    for (int64_t c0 = 0; c0 < cols; c0 += 32)
      for (int64_t c = c0; c < std::min(c0 + 32, cols); ++c)
        for (int64_t r = r0; r < std::min(r0 + 32, rows); ++r) out[c * rows + r] = in[r * cols + c];
}

std::string name(DType t) {
  return std::string(dtype_name(t));
}

}  // namespace

int main(int argc, char** argv) {
  double secs = 0.2;
  std::string which = "both";
  bool gemm_table = false, small = false, peak = false, ce = false, alt = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "gemm")
      gemm_table = true;
    else if (a == "small")
      small = true;
    else if (a == "peak")
      peak = true;
    else if (a == "ce")
      ce = true;
    else if (a == "alt")
      alt = gemm_table = true;
    else if (a == "f32" || a == "bf16" || a == "both")
      which = a;
    else
      secs = std::atof(a.c_str());
  }
  if (!gemm_table && !small && !peak && !ce) gemm_table = small = peak = true;
  const int64_t M = 2048;
  const std::pair<int64_t, int64_t> shapes[] = {
      {288 * 3, 288}, {288, 288}, {1536, 288}, {288, 768},  {4096, 288},
      {1024, 512},    {512, 512}, {2752, 512}, {512, 1376}, {8192, 512}};
  const char* forms[] = {"fwd y=xW^T", "bwd dx=dyW", "bwd dW+=dy^Tx", "dW via transpose"};
  std::vector<DType> dtypes;
  if (which != "bf16") dtypes.push_back(DType::f32);
  if (which != "f32") dtypes.push_back(DType::bf16);

  const int threads = omp_get_max_threads();
  std::printf(
      "threads %d. GFLOP/s of the fastest call, of the median call, and per CPU-second "
      "x threads\n",
      threads);
  std::printf("bf16 GEMMs: %s\n", gemm_bf16_path().c_str());
  if (gemm_table) {
    std::printf("%-6s %-6s %-6s %-17s %-9s %9s %9s %9s %9s\n", "M", "N", "K", "form", "dtype",
                "best ms", "GFLOP/s", "median", "cpu");
  }
  if (gemm_table)
    for (DType dt : dtypes) {
      for (auto [n, k] : shapes) {
        auto x = filled(M * k, dt, 1), w = filled(n * k, dt, 2), dy = filled(M * n, dt, 3);
        std::vector<float> out(std::max(M * n, std::max(M * k, n * k)));
        std::vector<bf16> dyt(dt == DType::bf16 ? M * n : 0);
        const int nforms = alt && dt == DType::bf16 ? 4 : 3;
        for (int form = 0; form < nforms; ++form) {
          const Timing tm = time_call(
              [&] {
                if (form == 0) linear_forward(x.data(), w.data(), out.data(), M, n, k, dt);
                if (form == 1)
                  linear_backward_input(dy.data(), w.data(), out.data(), M, n, k, dt, false);
                if (form == 2) linear_backward_weight(dy.data(), x.data(), out.data(), M, n, k, dt);
                if (form == 3) {
                  transpose_bf16(reinterpret_cast<const bf16*>(dy.data()), dyt.data(), M, n);
                  gemm({.M = n,
                        .N = k,
                        .K = M,
                        .A = dyt.data(),
                        .lda = M,
                        .B = x.data(),
                        .ldb = k,
                        .C = out.data(),
                        .ldc = k,
                        .ab = dt,
                        .accumulate = true});
                }
              },
              secs);
          const double flop = 2.0 * M * n * k;
          std::printf("%-6lld %-6lld %-6lld %-17s %-9s %9.3f %9.1f %9.1f %9.1f\n", (long long)M,
                      (long long)n, (long long)k, forms[form], name(dt).c_str(), tm.best * 1e3,
                      flop / tm.best * 1e-9, flop / tm.median * 1e-9,
                      flop / tm.cpu * threads * 1e-9);
        }
      }
    }

  // Per-call cost of a cached primitive on shapes where the arithmetic is negligible.
  if (small)
    for (DType dt : dtypes) {
      for (int64_t s : {4, 16, 64}) {
        auto a = filled(s * s, dt, 1), b = filled(s * s, dt, 2);
        std::vector<float> c(s * s);
        const Timing tm = time_call(
            [&] {
              gemm({.ta = Trans::N,
                    .tb = Trans::T,
                    .M = s,
                    .N = s,
                    .K = s,
                    .A = a.data(),
                    .lda = s,
                    .B = b.data(),
                    .ldb = s,
                    .C = c.data(),
                    .ldc = s,
                    .ab = dt,
                    .accumulate = true});
            },
            secs, 100);
        std::printf("small %lldx%lldx%lld %s: best %.2f us/call, median %.2f\n", (long long)s,
                    (long long)s, (long long)s, name(dt).c_str(), tm.best * 1e6, tm.median * 1e6);
      }
    }
  if (peak)
    for (DType dt : dtypes)
      std::printf("measure_gemm_peak(%s) = %.1f GFLOP/s\n", name(dt).c_str(),
                  measure_gemm_peak(dt, 1.0) * 1e-9);

  if (ce) {
    // The output projection + loss of the two benchmark models, forward and backward.
    for (const auto& [D, V] : {std::pair<int64_t, int64_t>{512, 8192}, {288, 4096}}) {
      const int64_t N = 2048;
      std::vector<int32_t> t(N);
      for (int64_t i = 0; i < N; ++i) t[i] = static_cast<int32_t>((i * 7919) % V);
      std::printf("\nlinear_cross_entropy N=%lld D=%lld V=%lld (3 GEMMs = %.1f GFLOP)\n",
                  (long long)N, (long long)D, (long long)V, 6.0 * N * D * V * 1e-9);
      for (DType dt : dtypes) {
        auto x = filled(N * D, dt, 1), w = filled(V * D, dt, 2);
        std::vector<float> dx(N * D), dw(V * D);
        const auto time_loss = [&](int64_t chunk, int64_t grad_rows) {
          return time_call(
              [&] {
                linear_cross_entropy({.x = x.data(),
                                      .w = w.data(),
                                      .ab = dt,
                                      .targets = t.data(),
                                      .N = N,
                                      .D = D,
                                      .V = V,
                                      .grad_scale = 1.0f / N,
                                      .dx = dx.data(),
                                      .dw = dw.data(),
                                      .chunk_rows = chunk,
                                      .grad_rows = grad_rows});
              },
              secs * 3);
        };
        for (int64_t chunk : {0, 16, 32, 64, 128, 256, 512, 1024, 2048}) {
          const Timing tm = time_loss(chunk, 0);
          std::printf(
              "  %-9s chunk %5lld%s: best %8.2f ms (%6.1f GFLOP/s), median %8.2f ms, cpu/threads "
              "%8.2f ms\n",
              name(dt).c_str(), (long long)chunk, chunk == 0 ? " (default)" : "", tm.best * 1e3,
              6.0 * N * D * V / tm.best * 1e-9, tm.median * 1e3, tm.cpu / threads * 1e3);
        }
        if (dt != DType::bf16) continue;
        // bf16: small chunks of f32 logits whose bf16 gradients gather into larger groups before
        // the backward GEMMs (LinearCrossEntropyArgs::grad_rows).
        for (int64_t chunk : {64, 96, 112, 128, 192, 256}) {
          for (int64_t grad_rows : {256, 512, 1024}) {
            if (grad_rows <= chunk) continue;
            const Timing tm = time_loss(chunk, grad_rows);
            std::printf(
                "  %-9s chunk %5lld grad_rows %5lld: best %8.2f ms (%6.1f GFLOP/s), median %8.2f "
                "ms, scratch %5.2f MiB\n",
                name(dt).c_str(), (long long)chunk, (long long)grad_rows, tm.best * 1e3,
                6.0 * N * D * V / tm.best * 1e-9, tm.median * 1e3,
                double(chunk * V * 4 + grad_rows / chunk * chunk * V * 2) / (1 << 20));
          }
        }
      }
    }
  }
  return 0;
}
