#include "kernels/cuda/measure.hpp"

#include <algorithm>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/gemm.hpp"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/vec.cuh"

namespace loom::cuda {

namespace {

__device__ uint32_t mix(uint64_t x) {
  // splitmix64's finalizer: a counter-based stream, the same values for any launch shape.
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return uint32_t((x ^ (x >> 31)) >> 32);
}
__global__ void uniform_bf16(uint16_t* __restrict x, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = float(mix(seed * 0x100000001b3ull + uint64_t(i))) * (1.0f / 4294967296.0f);
    x[i] = f32_to_bf16_bits((2.0f * u - 1.0f) * scale);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs `fn` once to warm up, then times repeats of it until about `seconds` have passed (at least
// 5); the median milliseconds of one.
template <class Fn>
double time_ms(double seconds, Fn&& fn) {
  EventTimer t;
  t.start();
  fn();
  t.stop();
  const double first = std::max(t.elapsed_ms(), 1e-3);
  const int reps = std::clamp(int(seconds * 1e3 / first), 5, 1000);
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    t.start();
    fn();
    t.stop();
    ms.push_back(t.elapsed_ms());
  }
  return median(ms);
}

}  // namespace

void fill_uniform_bf16(void* x, int64_t n, uint64_t seed, float scale) {
  if (n <= 0) return;
  const unsigned grid = std::min(blocks_for(n, 256), 4096u);
  uniform_bf16<<<grid, 256, 0, stream()>>>(static_cast<uint16_t*>(x), n, seed, scale);
  check_launch("fill_uniform_bf16");
}

double measure_gemm_peak_bf16(double seconds, int64_t n) {
  Tensor a = Tensor::empty({n, n}, DType::bf16, Device::cuda);
  Tensor b = Tensor::empty({n, n}, DType::bf16, Device::cuda);
  Tensor c = Tensor::empty({n, n}, DType::f32, Device::cuda);
  fill_uniform_bf16(a.raw(), n * n, 1, 1.0f);
  fill_uniform_bf16(b.raw(), n * n, 2, 1.0f);
  GemmArgs g;
  g.tb = Trans::T;  // the forward of a linear layer: x W^T
  g.M = g.N = g.K = n;
  g.A = a.raw();
  g.lda = n;
  g.B = b.raw();
  g.ldb = n;
  g.C = c.data<float>();
  g.ldc = n;
  g.ab = DType::bf16;
  const double ms = time_ms(seconds, [&] { cuda::gemm(g); });
  return 2.0 * double(n) * double(n) * double(n) / (ms * 1e-3);
}

double measure_copy_bandwidth(double seconds, int64_t bytes) {
  Tensor src = Tensor::empty({bytes / 2}, DType::bf16, Device::cuda);
  Tensor dst = Tensor::empty({bytes / 2}, DType::bf16, Device::cuda);
  fill_uniform_bf16(src.raw(), bytes / 2, 3, 1.0f);
  const double ms = time_ms(seconds, [&] {
    LOOM_CUDA_CHECK(
        cudaMemcpyAsync(dst.raw(), src.raw(), size_t(bytes), cudaMemcpyDeviceToDevice, stream()),
        "measure_copy_bandwidth");
  });
  return 2.0 * double(bytes) / (ms * 1e-3);
}

}  // namespace loom::cuda
