// The Allocator and Tensor of a device whose memory comes from a registered runtime
// (core/device_memory.hpp), with a fake runtime over host memory in place of CUDA: bookkeeping,
// the cache given back before an out-of-memory, the error's figures, and zero/copy going through
// the runtime. The CUDA runtime's own functions are tested on a GPU (tests/kernels/cuda/).
#include "core/device_memory.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"

namespace loom {
namespace {

// A device of kCapacity bytes; counts what the allocator and Tensor ask of it.
constexpr size_t kCapacity = size_t(8) << 20;
struct Fake {
  size_t used = 0;
  int reserves = 0, releases = 0, zeros = 0, copies = 0;
  bool last_to_device = false, last_from_device = false;
};
Fake g_fake;

void* fake_reserve(size_t bytes, bool) {
  if (g_fake.used + bytes > kCapacity) return nullptr;
  g_fake.used += bytes;
  g_fake.reserves++;
  // The size in front of the block, so release can give it back.
  auto* p = static_cast<size_t*>(std::malloc(bytes + 64));
  *p = bytes;
  return reinterpret_cast<char*>(p) + 64;
}
void fake_release(void* p, bool) {
  auto* base = reinterpret_cast<size_t*>(static_cast<char*>(p) - 64);
  g_fake.used -= *base;
  g_fake.releases++;
  std::free(base);
}
void fake_mem_info(size_t* free, size_t* total) {
  *free = kCapacity - g_fake.used;
  *total = kCapacity;
}
void fake_zero(void* dst, size_t bytes) {
  g_fake.zeros++;
  std::memset(dst, 0, bytes);
}
void fake_copy(void* dst, const void* src, size_t bytes, bool to_device, bool from_device) {
  g_fake.copies++;
  g_fake.last_to_device = to_device;
  g_fake.last_from_device = from_device;
  std::memcpy(dst, src, bytes);
}

void register_fake() {
  DeviceMemory m;
  m.reserve = fake_reserve;
  m.release = fake_release;
  m.mem_info = fake_mem_info;
  m.zero = fake_zero;
  m.copy = fake_copy;
  register_device_memory(Device::cuda, m);
}

TEST(DeviceMemory, WithoutARuntimeTheDeviceHasNoMemory) {
  if (device_memory(Device::cuda))
    GTEST_SKIP() << "a runtime was registered earlier in this process";
  try {
    Tensor::empty({4}, DType::f32, Device::cuda);
    FAIL() << "a cuda tensor without a runtime";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no memory for device cuda"), std::string::npos)
        << e.what();
  }
}

TEST(DeviceMemory, IncompleteRegistrationIsRefused) {
  DeviceMemory m;
  m.reserve = fake_reserve;
  EXPECT_THROW(register_device_memory(Device::cuda, m), Error);
}

TEST(DeviceMemory, AllocatorBooksAndCachesDeviceBlocks) {
  register_fake();
  Allocator& a = Allocator::get(Device::cuda);
  a.empty_cache();
  const AllocatorStats s0 = a.stats();
  const int reserves = g_fake.reserves;
  {
    Tensor t = Tensor::empty({1 << 18}, DType::f32, Device::cuda);  // 1 MiB
    EXPECT_EQ(a.stats().allocated, s0.allocated + (size_t(1) << 20));
    EXPECT_EQ(g_fake.reserves, reserves + 1);
  }
  // Freed into the cache, then reused without a new reservation.
  Tensor t = Tensor::empty({1 << 18}, DType::f32, Device::cuda);
  EXPECT_EQ(g_fake.reserves, reserves + 1);
  EXPECT_EQ(a.stats().reserved, s0.reserved + (size_t(1) << 20));
}

TEST(DeviceMemory, CacheIsGivenBackBeforeOutOfMemory) {
  register_fake();
  Allocator& a = Allocator::get(Device::cuda);
  a.empty_cache();
  // 5 MiB cached, then 6 MiB asked: only fits once the cache is released.
  { Tensor t = Tensor::empty({5 << 18}, DType::f32, Device::cuda); }
  const size_t flushes = a.stats().num_cache_flushes;
  Tensor big = Tensor::empty({6 << 18}, DType::f32, Device::cuda);
  EXPECT_EQ(a.stats().num_cache_flushes, flushes + 1);
  // Now 6 of 8 MiB are in use: 4 more cannot be had, and the error gives the figures.
  try {
    Tensor more = Tensor::empty({1 << 20}, DType::f32, Device::cuda);
    FAIL() << "allocated past the device's capacity";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("out of memory on cuda: allocating 4194304 bytes"), std::string::npos) << w;
    EXPECT_NE(w.find("the device has 2097152 of 8388608 bytes free"), std::string::npos) << w;
  }
}

TEST(DeviceMemory, ZeroAndCopiesGoThroughTheRuntime) {
  register_fake();
  Tensor h = Tensor::empty({6}, DType::f32);
  for (int i = 0; i < 6; ++i) h.data<float>()[i] = float(i) + 0.5f;
  Tensor d = Tensor::empty({6}, DType::f32, Device::cuda);
  const int copies = g_fake.copies;
  d.copy_from(h);
  EXPECT_TRUE(g_fake.last_to_device);
  EXPECT_FALSE(g_fake.last_from_device);
  Tensor e = Tensor::empty({6}, DType::f32, Device::cuda);
  e.copy_from(d);
  EXPECT_TRUE(g_fake.last_to_device && g_fake.last_from_device);
  Tensor back = Tensor::empty({6}, DType::f32);
  back.copy_from(e);
  EXPECT_FALSE(g_fake.last_to_device);
  EXPECT_TRUE(g_fake.last_from_device);
  EXPECT_EQ(g_fake.copies, copies + 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back.data<float>()[i], float(i) + 0.5f);
  const int zeros = g_fake.zeros;
  e.zero_();
  EXPECT_EQ(g_fake.zeros, zeros + 1);
  back.copy_from(e);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back.data<float>()[i], 0.0f);
  // A dtype conversion on the device is an op (ops::cast), not Tensor::to.
  EXPECT_THROW(d.to(DType::bf16), Error);
}

}  // namespace
}  // namespace loom
