#pragma once
// One caching allocator per device. Freed blocks are kept in a pool and reused for later requests
// of a similar size, so a training step allocates from the OS only on the first step. The
// statistics are what `loom bench` and `loom plan` report: `allocated` counts the bytes of live
// tensors, `reserved` also counts the cached blocks.
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "core/device.hpp"

namespace loom {

struct AllocatorStats {
  size_t allocated = 0;
  size_t peak_allocated = 0;
  size_t reserved = 0;
  size_t peak_reserved = 0;
  size_t num_allocs = 0;     // requests served
  size_t num_os_allocs = 0;  // requests that had to reserve new memory
};

class Allocator {
 public:
  explicit Allocator(Device device) : device_(device) {}
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // The allocator of a device; lives for the whole process.
  static Allocator& get(Device device);

  struct Block {
    void* ptr = nullptr;
    size_t size = 0;  // what was handed out (>= the request); pass it back to deallocate
  };
  // A block of at least `bytes`, 64-byte aligned. On the meta device the address is a unique tag
  // that must never be dereferenced.
  Block allocate(size_t bytes);
  void deallocate(Block block);

  AllocatorStats stats() const;
  void reset_peak();
  void empty_cache();            // returns cached blocks to the OS
  void set_limit(size_t bytes);  // allocations beyond it throw, naming the sizes
  static size_t round_size(size_t bytes);

  Device device() const { return device_; }

 private:
  void* os_alloc(size_t bytes);
  void os_free(void* ptr, size_t bytes);

  Device device_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> cache_;  // free blocks by size
  AllocatorStats stats_;
  size_t limit_ = 0;
  uintptr_t next_meta_ = 0x1000;
};

}  // namespace loom
