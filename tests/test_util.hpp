#pragma once
// Shared helpers of the unit tests: random inputs (never zeros), error measures, fp64 central
// finite differences, and running a kernel test on every CPU tier (for_each_isa, TEST_ALL_ISAS).
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

namespace loom::test {

// bf16 test data: rounded copies, widened back, and bit-for-bit comparison.
inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}
inline std::vector<float> widen(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
// Runs body with n OpenMP threads, restoring the count (a kernel's bits must not depend on it).
template <class Body>
void with_threads(int n, Body&& body) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  body();
  omp_set_num_threads(saved);
}

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Token ids in [0, vocab), Zipf-like (vocab times a product of three uniforms): many repeats, so
// several positions land on the same table row, as in text.
inline std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(double(vocab) * u(rng) * u(rng) * u(rng));
  return t;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// ||a - b|| / ||b|| (relative L2 error against the reference b).
template <class A, class B>
double rel_l2(const A& a, const B& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

template <class A, class B>
double max_abs_diff(const A& a, const B& b) {
  double m = 0;
  for (size_t i = 0; i < b.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

// Gradient of f at x by central differences in fp64.
inline std::vector<double> numeric_grad(const std::function<double(const std::vector<double>&)>& f,
                                        std::vector<double> x, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double x0 = x[i];
    x[i] = x0 + h;
    double fp = f(x);
    x[i] = x0 - h;
    double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// Expects f to throw loom::Error whose message contains every one of `parts` (the file, key,
// tensor or rank the message must name).
inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const loom::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "expected a loom::Error";
}

// The kernel tiers this process may run, lowest first: those of cpu_isa().available up to
// cpu_isa().kernels (so LOOM_CPU_ISA=avx2 leaves out avx512). Kernel tests run on each of them.
inline std::vector<cpu::Isa> kernel_isas() {
  const cpu::CpuIsa& c = cpu::cpu_isa();
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : c.available)
    if (int(isa) <= int(c.kernels)) out.push_back(isa);
  return out;
}

// The AVX512_BF16 instructions turned on or off for a scope (cpu::set_avx512_bf16_native_allowed),
// back to the default (on) at every exit of the scope, a failed fatal assertion's included, so
// that no later test runs with them off.
class ScopedBf16Native {
 public:
  explicit ScopedBf16Native(bool allowed) { cpu::set_avx512_bf16_native_allowed(allowed); }
  ~ScopedBf16Native() { cpu::set_avx512_bf16_native_allowed(true); }
  ScopedBf16Native(const ScopedBf16Native&) = delete;
  ScopedBf16Native& operator=(const ScopedBf16Native&) = delete;
};

// Runs body(isa) once per kernel tier with the kernels dispatched to that tier and a trace naming
// it on every failure. A fatal assertion in body ends that tier's run; the next tier still runs.
template <class Body>
void for_each_isa(Body&& body) {
  for (cpu::Isa isa : kernel_isas()) {
    SCOPED_TRACE(std::string("kernel tier ") + cpu::isa_name(isa));
    cpu::ScopedKernelIsa scope(isa);
    body(isa);
  }
}

}  // namespace loom::test

// A test whose body runs once per kernel tier (test::for_each_isa), written like TEST:
//   TEST_ALL_ISAS(SwiGLU, Forward) { ... }
// Fatal assertions end the body for that tier only. Where the body computes an expensive fp64
// reference or finite differences, use TEST and put for_each_isa around the kernel part instead,
// so the reference is computed once.
#define TEST_ALL_ISAS(suite, name)                                                    \
  static void suite##_##name##_AllIsas();                                             \
  TEST(suite, name) {                                                                 \
    ::loom::test::for_each_isa([](::loom::cpu::Isa) { suite##_##name##_AllIsas(); }); \
  }                                                                                   \
  static void suite##_##name##_AllIsas()
