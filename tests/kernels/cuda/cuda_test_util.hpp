#pragma once
// Shared helpers of the CUDA kernel tests: the fixture that starts GPU 0 or skips
// (LOOM_REQUIRE_GPU=1 turns the skip into a failure: scripts/device_check.sh sets it), and device
// buffers that come from the backend's allocator, filled with NaN before a kernel writes them so an
// element the kernel missed fails the comparison.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/runtime.hpp"
#include "tests/test_util.hpp"

namespace loom::test {

inline bool gpu_required() {
  const char* v = std::getenv("LOOM_REQUIRE_GPU");
  return v && std::strcmp(v, "1") == 0;
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const cuda::RuntimeInfo& r = cuda::probe();
    if (!r.usable) {
      if (gpu_required()) FAIL() << "LOOM_REQUIRE_GPU=1 but no GPU: " << r.why_not;
      GTEST_SKIP() << "no GPU: " << r.why_not;
    }
    cuda::start(0);
  }
};

// A host tensor holding `v` (f32, or rounded to bf16 when dt is bf16): a CPU kernel's input.
inline Tensor to_host_tensor(const std::vector<float>& v, DType dt = DType::f32) {
  Tensor h = Tensor::empty({int64_t(v.size())}, DType::f32);
  if (!v.empty()) std::memcpy(h.raw(), v.data(), v.size() * sizeof(float));
  return dt == DType::bf16 ? h.to(DType::bf16) : h;
}
// A device tensor holding `v` (f32, or rounded to bf16 when dt is bf16).
inline Tensor to_device(const std::vector<float>& v, DType dt = DType::f32) {
  Tensor h = to_host_tensor(v, dt);
  Tensor d = Tensor::empty({int64_t(v.size())}, dt, Device::cuda);
  d.copy_from(h);
  return d;
}
inline Tensor to_device_i32(const std::vector<int32_t>& v) {
  Tensor h = Tensor::empty({int64_t(v.size())}, DType::i32);
  if (!v.empty()) std::memcpy(h.raw(), v.data(), v.size() * sizeof(int32_t));
  Tensor d = Tensor::empty({int64_t(v.size())}, DType::i32, Device::cuda);
  d.copy_from(h);
  return d;
}
// A device tensor of n elements every one of which is NaN (f32 or bf16).
inline Tensor nan_device(int64_t n, DType dt = DType::f32) {
  return to_device(std::vector<float>(size_t(n), std::numeric_limits<float>::quiet_NaN()), dt);
}
// The device tensor's values on the host, widened to f32.
inline std::vector<float> to_host(const Tensor& d) {
  Tensor h = Tensor::empty(d.shape(), d.dtype());
  h.copy_from(d);
  if (d.dtype() == DType::bf16) h = h.to(DType::f32);
  std::vector<float> v(size_t(h.numel()));
  if (!v.empty()) std::memcpy(v.data(), h.raw(), v.size() * sizeof(float));
  return v;
}
// The device tensor's raw bf16 values.
inline std::vector<bf16> to_host_bf16(const Tensor& d) {
  Tensor h = Tensor::empty(d.shape(), DType::bf16);
  h.copy_from(d);
  std::vector<bf16> v(size_t(h.numel()));
  if (!v.empty()) std::memcpy(v.data(), h.raw(), v.size() * sizeof(bf16));
  return v;
}

// ---- bf16 helpers and offset device arrays (the kernel tests share them)
// (widen and same_bits: tests/test_util.hpp.)
inline std::vector<bf16> round_bf16(const std::vector<float>& v) {
  return to_bf16(v);
}

// A device array holding v `off` elements into its buffer (off > 0: a pointer that is not 16-byte
// aligned, as a view into a larger buffer), and its contents read back past the offset.
struct Dev {
  Tensor t;
  int64_t off = 0;
  float* f() const { return t.data<float>() + off; }
  bf16* h() const { return t.data<bf16>() + off; }
  std::vector<float> host() const {
    auto v = test::to_host(t);
    return std::vector<float>(v.begin() + off, v.end());
  }
  std::vector<bf16> host_bf16() const {
    auto v = test::to_host_bf16(t);
    return std::vector<bf16>(v.begin() + off, v.end());
  }
};

inline Dev dev(const std::vector<float>& v, int64_t off = 0, DType dt = DType::f32) {
  std::vector<float> padded(size_t(off), 1.0f);
  padded.insert(padded.end(), v.begin(), v.end());
  return {test::to_device(padded, dt), off};
}

inline Dev nan_dev(int64_t n, int64_t off = 0, DType dt = DType::f32) {
  return {test::nan_device(n + off, dt), off};
}

// bf16 bits as a position on the number line: neighbours differ by one (+0 and -0 both 0).
// The times this process has waited for the GPU, whatever waited (cuda::host_waits).
inline uint64_t host_wait_count() {
  uint64_t k = 0;
  for (const auto& [what, count] : cuda::host_waits()) k += count;
  return k;
}

inline int ordered(bf16 v) {
  return (v.bits & 0x8000) ? -int(v.bits & 0x7fff) : int(v.bits);
}

}  // namespace loom::test
