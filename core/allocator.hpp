#pragma once
// One caching allocator per device. Freed blocks are kept in a pool and reused for later requests
// of a similar size, so a training step allocates from the OS only on the first step. The
// statistics are what `loom bench` and `loom plan` report: `allocated` counts the bytes of live
// tensors, `reserved` also counts the cached blocks.
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>

#include "core/device.hpp"

namespace loom {

// What a block is for: the planner's breakdown of a peak. An allocation takes the use set on its
// allocator when it is made (MemoryUseScope); `work` is the default: activations saved for
// backward and the working buffers of the step.
enum class MemoryUse : uint8_t { work, states, optimizer, gathered, communication, loss };
inline constexpr size_t kMemoryUses = 6;
std::string_view memory_use_name(MemoryUse u);

// Which of a device's two allocators a block comes from: the device's own memory, or the host
// memory that holds its offloaded states (CPU offload, docs/design.md decision 4: master weights,
// gradient shards and AdamW moments). On the cpu device both are the same RAM, booked apart so
// that a run here measures what a GPU would hold; on meta neither has memory behind it.
enum class Pool : uint8_t { device, host };
std::string_view pool_name(Pool p);

struct AllocatorStats {
  size_t allocated = 0;
  size_t peak_allocated = 0;
  size_t reserved = 0;
  size_t peak_reserved = 0;
  size_t num_allocs = 0;     // requests served
  size_t num_os_allocs = 0;  // requests that had to reserve new memory
  // Requests that found the limit reached and gave the cache back first: on a GPU each is a
  // synchronizing free (torch's num_alloc_retries).
  size_t num_cache_flushes = 0;
  std::array<size_t, kMemoryUses> by_use{};          // allocated, by use
  std::array<size_t, kMemoryUses> by_use_at_peak{};  // the same at the peak of `allocated`
};

class Allocator {
 public:
  explicit Allocator(Device device, Pool pool = Pool::device) : device_(device), pool_(pool) {}
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // The allocator of a device's pool; lives for the whole process.
  static Allocator& get(Device device, Pool pool = Pool::device);

  struct Block {
    void* ptr = nullptr;
    size_t size = 0;  // what was handed out (>= the request); pass it back to deallocate
    MemoryUse use = MemoryUse::work;
  };
  // A block of at least `bytes`, 64-byte aligned. On the meta device the address is a unique tag
  // that must never be dereferenced.
  Block allocate(size_t bytes);
  void deallocate(Block block);

  AllocatorStats stats() const;
  void reset_peak();
  void empty_cache();  // returns cached blocks to the OS
  // Beyond `bytes` reserved an allocation gives the cache back, then throws if still beyond it,
  // naming the sizes (0: no limit).
  void set_limit(size_t bytes);
  size_t limit() const;
  static size_t round_size(size_t bytes);

  Device device() const { return device_; }
  Pool pool() const { return pool_; }
  // The use later allocations are booked under; returns the previous one.
  MemoryUse set_use(MemoryUse use);

 private:
  // nullptr where a device runtime has no memory left (host memory failing is an error at once).
  void* os_alloc(size_t bytes);
  void os_free(void* ptr, size_t bytes);
  // Gives every cached block back (mu_ held).
  void flush_cache_locked();
  [[noreturn]] void out_of_device_memory(size_t size) const;

  Device device_;
  Pool pool_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> cache_;  // free blocks by size
  AllocatorStats stats_;
  size_t limit_ = 0;
  uintptr_t next_meta_ = 0x1000;
  MemoryUse use_ = MemoryUse::work;
};

// Books the allocations made on `device` during its life under `use` (then restores the previous
// use): the model's states, the optimizer's, FSDP's gathered units, communication buffers...
class MemoryUseScope {
 public:
  MemoryUseScope(Device device, MemoryUse use)
      : alloc_(Allocator::get(device)), prev_(alloc_.set_use(use)) {}
  ~MemoryUseScope() { alloc_.set_use(prev_); }
  MemoryUseScope(const MemoryUseScope&) = delete;
  MemoryUseScope& operator=(const MemoryUseScope&) = delete;

 private:
  Allocator& alloc_;
  MemoryUse prev_;
};

}  // namespace loom
