#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "core/allocator.hpp"
#include "core/philox.hpp"
#include "core/tensor.hpp"

using namespace loom;

TEST(Allocator, ReusesFreedBlocksAndTracksPeaks) {
  Allocator a(Device::cpu);
  auto b1 = a.allocate(1000);
  EXPECT_EQ(b1.size, 1024u);
  auto s = a.stats();
  EXPECT_EQ(s.allocated, 1024u);
  EXPECT_EQ(s.reserved, 1024u);
  a.deallocate(b1);
  EXPECT_EQ(a.stats().allocated, 0u);
  EXPECT_EQ(a.stats().reserved, 1024u);
  auto b2 = a.allocate(900);  // served from the cache
  EXPECT_EQ(b2.ptr, b1.ptr);
  EXPECT_EQ(a.stats().num_os_allocs, 1u);
  auto b3 = a.allocate(5 << 20);
  EXPECT_EQ(a.stats().peak_allocated, 1024u + (5u << 20));
  a.deallocate(b3);
  a.deallocate(b2);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved, 0u);
  EXPECT_EQ(a.stats().peak_reserved, 1024u + (5u << 20));
}

TEST(Allocator, LimitGivesClearError) {
  Allocator a(Device::meta);
  a.set_limit(1 << 20);
  auto b = a.allocate(600 << 10);
  try {
    a.allocate(600 << 10);
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the limit"), std::string::npos) << e.what();
  }
  a.deallocate(b);
}

// At the limit the cache goes back first (counted as a flush); only then does it fail.
TEST(Allocator, LimitGivesTheCacheBackBeforeFailing) {
  Allocator a(Device::meta);
  a.set_limit(3 << 20);
  a.deallocate(a.allocate(2 << 20));  // cached: 2 MiB reserved, none allocated
  auto b = a.allocate(1536 << 10);    // too small a request to reuse the cached block
  EXPECT_EQ(a.stats().num_cache_flushes, 1u);
  EXPECT_EQ(a.stats().reserved, size_t(1536) << 10);
  auto c = a.allocate(1 << 20);  // fits beside b: no flush
  EXPECT_EQ(a.stats().num_cache_flushes, 1u);
  EXPECT_THROW(a.allocate(1 << 20), Error);
  EXPECT_EQ(a.stats().num_cache_flushes, 2u);
  a.deallocate(b);
  a.deallocate(c);
}

TEST(Tensor, ViewsShareStorageAndCountBytes) {
  auto before = Allocator::get(Device::cpu).stats().allocated;
  {
    Tensor t = Tensor::zeros({4, 6}, DType::f32);
    EXPECT_EQ(Allocator::get(Device::cpu).stats().allocated - before, 512u);
    float* p = t.data<float>();
    std::iota(p, p + 24, 0.0f);
    Tensor row = t[2];
    EXPECT_EQ(row.shape(), (Shape{6}));
    EXPECT_EQ(row.data<float>()[1], 13.0f);
    Tensor col = t.narrow(1, 3, 2);
    EXPECT_FALSE(col.is_contiguous());
    EXPECT_THROW(t.view({5, 5}), Error);
    EXPECT_THROW(t.data<bf16>(), Error);
    Tensor h = t.to(DType::bf16).to(DType::f32);
    EXPECT_EQ(h.data<float>()[23], 23.0f);
  }
  EXPECT_EQ(Allocator::get(Device::cpu).stats().allocated, before);
}

TEST(Tensor, MetaDeviceCountsWithoutMemory) {
  auto& m = Allocator::get(Device::meta);
  auto before = m.stats().allocated;
  Tensor t = Tensor::empty({1 << 20, 1 << 10}, DType::bf16, Device::meta);  // 2 GiB, not touched
  EXPECT_EQ(m.stats().allocated - before, size_t(2) << 30);
  t.zero_();
}

// CPU offload's host pool: the same RAM on cpu, booked apart from the device's allocator (whose
// peak is what a GPU would hold); on meta a second allocator without memory.
TEST(Allocator, HostPoolIsBookedApartFromTheDevice) {
  for (Device d : {Device::cpu, Device::meta}) {
    auto& dev = Allocator::get(d);
    auto& host = Allocator::get(d, Pool::host);
    ASSERT_NE(&dev, &host);
    EXPECT_EQ(host.pool(), Pool::host);
    const size_t dev_before = dev.stats().allocated, host_before = host.stats().allocated;
    {
      Tensor h = Tensor::zeros({1000}, DType::f32, d, Pool::host);
      Tensor v = h.narrow(0, 10, 20);
      EXPECT_EQ(h.pool(), Pool::host);
      EXPECT_EQ(v.pool(), Pool::host);  // views keep their storage's pool
      EXPECT_EQ(h.device(), d);
      EXPECT_EQ(dev.stats().allocated, dev_before);
      EXPECT_EQ(host.stats().allocated - host_before, Allocator::round_size(4000));
      Tensor t = Tensor::empty({10}, DType::f32, d);
      EXPECT_EQ(t.pool(), Pool::device);
      EXPECT_EQ(dev.stats().allocated - dev_before, Allocator::round_size(40));
    }
    EXPECT_EQ(dev.stats().allocated, dev_before);
    EXPECT_EQ(host.stats().allocated, host_before);
  }
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.00390625f)), 1.0f);       // tie -> even
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.01171875f)), 1.015625f);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(Philox, KnownAnswerAndLayoutIndependence) {
  // Known-answer vector of Philox4x32-10 from the Random123 distribution (kat_vectors).
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  uint64_t key = philox_key(1234, "model.layers.0.mlp.up_proj.weight");
  std::vector<float> whole(1000), part(300);
  philox_normal(key, 0, 1000, 0.0f, 0.02f, whole.data());
  philox_normal(key, 500, 300, 0.0f, 0.02f, part.data());
  for (int i = 0; i < 300; ++i) ASSERT_EQ(part[i], whole[500 + i]);
  double mean = 0, var = 0;
  for (float x : whole) mean += x;
  mean /= 1000;
  for (float x : whole) var += (x - mean) * (x - mean);
  EXPECT_NEAR(mean, 0.0, 0.003);
  EXPECT_NEAR(std::sqrt(var / 999), 0.02, 0.002);
  EXPECT_NE(philox_key(1234, "a"), philox_key(1234, "b"));
  EXPECT_NE(philox_key(1234, "a"), philox_key(1235, "a"));
}
