// cuda_emu_planted MODE: kernels with one bug each that compute-sanitizer reports on a GPU, run on
// the CUDA emulation (tests/cuda_emu/), so that scripts/cuda_emu_sanitize.sh can hold each
// sanitizer to finding its kind (a check that cannot fail proves nothing). Host C++ for the
// emulation only (cmake/cuda_emu.cmake rewrites it with cu_to_cpp, as the backend's .cu files).
//   read_past          a kernel reads one float past its tensor, inside the allocator's rounding
//   use_after_free     a kernel reads a tensor freed into the allocator's cache
//   shared_past        a thread writes past the block's dynamic shared memory
//   race_shared        threads read a neighbour's shared word with no __syncthreads between
//   race_warp          lanes read a neighbour's shared word with no __syncwarp between
//   race_global        the threads of a block add to one global word without an atomic
//   clean              each kernel above without its bug; the results checked (exit 1 if wrong)
// With no sanitizer the buggy modes run to the end (their results are not checked).
#include <cstdio>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "kernels/cuda/runtime.hpp"

namespace {

using loom::Device;
using loom::DType;
using loom::Tensor;

__global__ void shifted_copy(const float* x, float* y, int n, int shift) {
  const int i = int(threadIdx.x);
  if (i < n) y[i] = x[i + shift];
}

__global__ void fill_shared(float* y, int n) {
  extern __shared__ float s[];
  s[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) y[0] = s[n - 1];
}

__global__ void neighbours(float* y, int block_sync, int warp_sync) {
  __shared__ float s[64];
  s[threadIdx.x] = float(threadIdx.x);
  if (block_sync) __syncthreads();
  if (warp_sync) __syncwarp();
  y[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

__global__ void count(int* c, int atomic) {
  if (atomic)
    atomicAdd(c, 1);
  else
    *c = *c + 1;
}

std::vector<float> host(const Tensor& d) {
  Tensor h = Tensor::empty(d.shape(), d.dtype());
  h.copy_from(d);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

Tensor device(const std::vector<float>& v) {
  Tensor h = Tensor::empty({int64_t(v.size())}, DType::f32);
  for (size_t i = 0; i < v.size(); ++i) h.data<float>()[i] = v[i];
  Tensor d = Tensor::empty({int64_t(v.size())}, DType::f32, Device::cuda);
  d.copy_from(h);
  return d;
}

int fails = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "cuda_emu_planted clean: %s is wrong\n", what);
    ++fails;
  }
}

// 100 floats: 400 bytes of a 512-byte block, so a read of x[100] stays inside the block.
void copies(bool past, bool after_free) {
  constexpr int n = 100;
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[size_t(i)] = float(i) + 0.5f;
  Tensor x = device(v), y = Tensor::empty({n}, DType::f32, Device::cuda);
  const float* xp = x.data<float>();
  if (after_free) x = Tensor();  // back to the cache; xp dangles
  shifted_copy<<<1, n>>>(xp, y.data<float>(), n, past ? 1 : 0);
  if (!past && !after_free) expect(host(y) == v, "shifted_copy");
}

void shared(bool past) {
  constexpr int n = 60;  // 240 bytes of dynamic shared memory, a multiple of 16
  Tensor y = Tensor::empty({1}, DType::f32, Device::cuda);
  fill_shared<<<1, past ? n + 1 : n, n * sizeof(float)>>>(y.data<float>(), n);
  if (!past) expect(host(y)[0] == float(n - 1), "fill_shared");
}

void races(int threads, bool block_sync, bool warp_sync, bool check) {
  Tensor y = Tensor::empty({threads}, DType::f32, Device::cuda);
  neighbours<<<1, threads>>>(y.data<float>(), block_sync, warp_sync);
  if (!check) return;
  std::vector<float> want(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) want[size_t(i)] = float((i + 1) % threads);
  expect(host(y) == want, "neighbours");
}

void counts(bool atomic) {
  Tensor c = Tensor::empty({1}, DType::i32, Device::cuda);
  c.zero_();
  count<<<1, 64>>>(c.data<int>(), atomic);
  if (atomic) {
    Tensor h = Tensor::empty({1}, DType::i32);
    h.copy_from(c);
    expect(h.data<int>()[0] == 64, "count");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  loom::cuda::start(0);
  if (mode == "read_past") {
    copies(true, false);
  } else if (mode == "use_after_free") {
    copies(false, true);
  } else if (mode == "shared_past") {
    shared(true);
  } else if (mode == "race_shared") {
    races(64, false, false, false);
  } else if (mode == "race_warp") {
    races(32, false, false, false);
  } else if (mode == "race_global") {
    counts(false);
  } else if (mode == "clean") {
    copies(false, false);
    shared(false);
    races(64, true, false, true);
    races(32, false, true, true);
    counts(true);
  } else {
    std::fprintf(stderr,
                 "usage: cuda_emu_planted read_past|use_after_free|shared_past|race_shared|"
                 "race_warp|race_global|clean\n");
    return 2;
  }
  loom::cuda::synchronize("cuda_emu_planted");
  return fails ? 1 : 0;
}
