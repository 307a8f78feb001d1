// Deliberately wrong: AVX2 code outside Highway's per-target namespaces, which
// tests/kernels/baseline_isa_check.sh must name (ctest baseline_isa_check_detects_avx), next to
// the same code inside a per-target namespace, which it must allow.
#include <immintrin.h>

__attribute__((target("avx2,fma"), noinline)) float avx_outside_dispatch(const float* x) {
  const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x), _mm256_setzero_ps());
  float out[8];
  _mm256_storeu_ps(out, v);
  return out[0] + out[7];
}

namespace loom::cpu::N_AVX2 {
__attribute__((target("avx2,fma"), noinline)) float avx_inside_dispatch(const float* x) {
  const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x), _mm256_setzero_ps());
  float out[8];
  _mm256_storeu_ps(out, v);
  return out[0] + out[7];
}
}  // namespace loom::cpu::N_AVX2

int main(int argc, char**) {
  float x[8] = {};
  // Never called at run time: only the disassembly matters.
  if (argc > 100) return int(avx_outside_dispatch(x) + loom::cpu::N_AVX2::avx_inside_dispatch(x));
  return 0;
}
