// The runtime's probe and start without a GPU (what every machine of CI sees), the version
// strings, and on a GPU the memory functions behind Device::cuda's allocator and Tensor.
#include "kernels/cuda/runtime.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "kernels/cuda/measure.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

namespace loom::cuda {
namespace {

TEST(CudaRuntimeHost, VersionStrings) {
  EXPECT_EQ(cuda_version_str(13000), "13.0");
  EXPECT_EQ(cuda_version_str(12080), "12.8");
  EXPECT_EQ(cublaslt_version_str(130100), "13.1.0");
  EXPECT_EQ(cublaslt_version_str(120903), "12.9.3");
}

TEST(CudaRuntimeHost, ProbeSaysWhyNotOrListsGpus) {
  const RuntimeInfo& r = probe();
  EXPECT_GE(r.runtime_version, 13000);
  EXPECT_GT(r.cublaslt_version, 0u);
  if (r.usable) {
    EXPECT_FALSE(r.gpus.empty());
    EXPECT_GT(r.driver_version, 0);
    for (const Gpu& g : r.gpus) {
      EXPECT_FALSE(g.name.empty());
      EXPECT_GT(g.sms, 0);
      EXPECT_GT(g.memory_bytes, 0u);
    }
  } else {
    EXPECT_FALSE(r.why_not.empty());
    EXPECT_TRUE(r.gpus.empty());
  }
}

TEST(CudaRuntimeHost, StartWithoutAGpuNamesWhy) {
  const RuntimeInfo& r = probe();
  if (r.usable) GTEST_SKIP() << "a GPU is present (the GPU tests cover start)";
  try {
    start(0);
    FAIL() << "start(0) succeeded without a GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(r.why_not), std::string::npos) << e.what();
  }
  EXPECT_EQ(current_device(), -1);
  // Without a started runtime, Device::cuda has no memory: a clear error, not a crash.
  EXPECT_THROW(Tensor::empty({4}, DType::f32, Device::cuda), Error);
}

class CudaRuntime : public test::CudaTest {};

TEST_F(CudaRuntime, TensorsMoveBetweenHostAndDevice) {
  const std::vector<float> x = test::randn(1000, 1);
  Tensor d = test::to_device(x);
  EXPECT_EQ(d.device(), Device::cuda);
  EXPECT_EQ(test::to_host(d), x);
  // A device-to-device copy and a zeroing, in stream order.
  Tensor e = Tensor::empty({1000}, DType::f32, Device::cuda);
  e.copy_from(d);
  EXPECT_EQ(test::to_host(e), x);
  d.zero_();
  for (float v : test::to_host(d)) ASSERT_EQ(v, 0.0f);
}

TEST_F(CudaRuntime, AllocatorBooksDeviceMemory) {
  Allocator& a = Allocator::get(Device::cuda);
  const AllocatorStats before = a.stats();
  {
    Tensor t = Tensor::empty({int64_t(1) << 20}, DType::f32, Device::cuda);
    EXPECT_GE(a.stats().allocated, before.allocated + (size_t(4) << 20));
  }
  EXPECT_EQ(a.stats().allocated, before.allocated);
  // A second tensor of the size reuses the cached block: no new cudaMalloc.
  const size_t os = a.stats().num_os_allocs;
  Tensor t = Tensor::empty({int64_t(1) << 20}, DType::f32, Device::cuda);
  EXPECT_EQ(a.stats().num_os_allocs, os);
}

TEST_F(CudaRuntime, OutOfMemoryNamesTheBytes) {
  const size_t too_much = probe().gpus[0].memory_bytes * 2;
  try {
    Tensor t = Tensor::empty({int64_t(too_much / 4)}, DType::f32, Device::cuda);
    FAIL() << "allocated twice the GPU's memory";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("out of memory on cuda"), std::string::npos) << w;
    EXPECT_NE(w.find("bytes free"), std::string::npos) << w;
  }
  // The device still works after it.
  Tensor ok = test::to_device({1.0f, 2.0f});
  EXPECT_EQ(test::to_host(ok), (std::vector<float>{1.0f, 2.0f}));
}

TEST_F(CudaRuntime, CeilingsAreMeasured) {
  // Small sizes: this checks that the measurement runs and gives a plausible figure; the
  // figures themselves come from `loom info` (scripts/device_check.sh).
  EXPECT_GT(measure_gemm_peak_bf16(0.05, 1024), 1e12);
  EXPECT_GT(measure_copy_bandwidth(0.05, int64_t(64) << 20), 1e11);
}

}  // namespace
}  // namespace loom::cuda
