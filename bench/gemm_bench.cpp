// GFLOP/s of the oneDNN GEMMs at the linear-layer shapes of the target models (tokens M=2048), in
// the three forms the model uses, f32 and bf16; plus the per-call overhead on tiny shapes.
// Usage: gemm_bench [seconds_per_case=0.2] [f32|bf16|both]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "kernels/cpu/gemm.hpp"

using namespace loom;
using namespace loom::cpu;
using Clock = std::chrono::steady_clock;

namespace {

template <class F>
double time_per_call(F&& f, double seconds) {
  f();  // builds the primitive
  f();
  int iters = 0;
  const auto t0 = Clock::now();
  double dt = 0;
  do {
    f();
    ++iters;
    dt = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (dt < seconds || iters < 3);
  return dt / iters;
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

}  // namespace

int main(int argc, char** argv) {
  const double secs = argc > 1 ? std::atof(argv[1]) : 0.2;
  const std::string which = argc > 2 ? argv[2] : "both";
  const int64_t M = 2048;
  const std::pair<int64_t, int64_t> shapes[] = {
      {288 * 3, 288}, {288, 288}, {1536, 288}, {288, 768},  {4096, 288},
      {1024, 512},    {512, 512}, {2752, 512}, {512, 1376}, {8192, 512}};
  const char* forms[] = {"fwd  y=xW^T", "bwd dx=dyW", "bwd dW+=dy^Tx"};
  std::vector<DType> dtypes;
  if (which != "bf16") dtypes.push_back(DType::f32);
  if (which != "f32") dtypes.push_back(DType::bf16);

  std::printf("%-6s %-6s %-6s %-15s %-9s %10s %10s\n", "M", "N", "K", "form", "dtype", "ms",
              "GFLOP/s");
  for (DType dt : dtypes) {
    for (auto [n, k] : shapes) {
      auto x = filled(M * k, dt, 1), w = filled(n * k, dt, 2), dy = filled(M * n, dt, 3);
      std::vector<float> out(std::max(M * n, std::max(M * k, n * k)));
      for (int form = 0; form < 3; ++form) {
        const double s = time_per_call(
            [&] {
              if (form == 0) linear_forward(x.data(), w.data(), out.data(), M, n, k, dt);
              if (form == 1)
                linear_backward_input(dy.data(), w.data(), out.data(), M, n, k, dt, false);
              if (form == 2) linear_backward_weight(dy.data(), x.data(), out.data(), M, n, k, dt);
            },
            secs);
        std::printf("%-6lld %-6lld %-6lld %-15s %-9s %10.3f %10.1f\n", (long long)M, (long long)n,
                    (long long)k, forms[form], std::string(dtype_name(dt)).c_str(), s * 1e3,
                    2.0 * M * n * k / s * 1e-9);
      }
    }
  }

  // Per-call cost of a cached primitive on shapes where the arithmetic is negligible.
  for (DType dt : dtypes) {
    for (int64_t s : {4, 16, 64}) {
      auto a = filled(s * s, dt, 1), b = filled(s * s, dt, 2);
      std::vector<float> c(s * s);
      const double t = time_per_call(
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
          secs);
      std::printf("small %lldx%lldx%lld %s: %.2f us/call\n", (long long)s, (long long)s,
                  (long long)s, std::string(dtype_name(dt)).c_str(), t * 1e6);
    }
  }
  for (DType dt : dtypes)
    std::printf("measure_gemm_peak(%s) = %.1f GFLOP/s\n", std::string(dtype_name(dt)).c_str(),
                measure_gemm_peak(dt, 1.0) * 1e-9);
  return 0;
}
