#include "core/allocator.hpp"

#include <cstdlib>
#include <utility>

#include <sanitizer/asan_interface.h>  // its macros do nothing without AddressSanitizer
#include <sys/mman.h>

#include "core/device_memory.hpp"
#include "core/error.hpp"

namespace loom {

std::string_view device_name(Device d) {
  switch (d) {
    case Device::cpu:
      return "cpu";
    case Device::cuda:
      return "cuda";
    case Device::meta:
      return "meta";
    case Device::elsewhere:
      return "elsewhere";
  }
  return "?";
}

std::string_view memory_use_name(MemoryUse u) {
  switch (u) {
    case MemoryUse::work:
      return "activations and working buffers";
    case MemoryUse::states:
      return "parameters, gradients, bf16 copies";
    case MemoryUse::optimizer:
      return "optimizer state";
    case MemoryUse::gathered:
      return "gathered units and full gradients";
    case MemoryUse::communication:
      return "communication buffers";
    case MemoryUse::loss:
      return "loss workspace";
  }
  return "?";
}

std::string_view pool_name(Pool p) {
  return p == Pool::host ? "host" : "device";
}

MemoryUse Allocator::set_use(MemoryUse use) {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(use_, use);
}

Allocator& Allocator::get(Device device, Pool pool) {
  // The per-device allocators are the one piece of process-wide state (docs/design.md decision 9).
  static Allocator cpu(Device::cpu), cpu_host(Device::cpu, Pool::host);
  static Allocator meta(Device::meta), meta_host(Device::meta, Pool::host);
  static Allocator elsewhere(Device::elsewhere);
  static Allocator cuda(Device::cuda), cuda_host(Device::cuda, Pool::host);
  const bool host = pool == Pool::host;
  switch (device) {
    case Device::cpu:
      return host ? cpu_host : cpu;
    case Device::meta:
      return host ? meta_host : meta;
    case Device::elsewhere:
      // Another rank's tensor: no memory here, whichever pool it lives in there.
      return elsewhere;
    case Device::cuda:
      LOOM_CHECK(device_memory(device), "no memory for device cuda: ",
                 "this loom has no CUDA backend, or its runtime was not started (no GPU in use)");
      return host ? cuda_host : cuda;
  }
  fail("no allocator for device ", device_name(device));
}

namespace {

// Under AddressSanitizer, whether the CPU may touch the allocator's memory: host memory, or a
// device's that is the host's (the CUDA emulation).
bool poisonable(Device device, Pool pool) {
  if (device == Device::cpu || pool == Pool::host) return true;
  const DeviceMemory* m = device_memory(device);
  return m && m->host_addressable;
}

}  // namespace

Allocator::~Allocator() {
  empty_cache();
}

size_t Allocator::round_size(size_t bytes) {
  // Small blocks round to 512 bytes, large ones to 2 MiB pages' 1/16 so that reuse is likely
  // while internal waste stays under ~6%.
  if (bytes == 0) bytes = 1;
  if (bytes <= (1u << 20)) return (bytes + 511) & ~size_t(511);
  size_t step = size_t(1) << 16;
  return (bytes + step - 1) & ~(step - 1);
}

void* Allocator::os_alloc(size_t bytes) {
  if (const DeviceMemory* m = device_memory(device_); m && device_ != Device::cpu)
    return m->reserve(bytes, pool_ == Pool::host);
  if (!holds_data(device_)) {
    void* p = reinterpret_cast<void*>(next_meta_);
    next_meta_ += bytes;
    return p;
  }
  // Large blocks start on a 2 MiB boundary and ask for transparent huge pages (the kernel's
  // default here is madvise-only): the streaming kernels and GEMMs then miss the TLB far less, and
  // the hardware prefetchers are not stopped at every 4 KiB (bench-small bf16: 2% off the step).
  // Only whole huge pages are advised, so a block's tail never holds more memory than it uses.
  constexpr size_t kHuge = size_t(2) << 20;
  void* p = nullptr;
  // posix_memalign: unlike aligned_alloc, the size need not be a multiple of the alignment.
  if (posix_memalign(&p, bytes >= kHuge ? kHuge : 64, bytes) != 0)
    fail("out of host memory: could not allocate ", bytes, " bytes");
  if (bytes >= kHuge) madvise(p, bytes & ~(kHuge - 1), MADV_HUGEPAGE);
  return p;
}

void Allocator::os_free(void* ptr, size_t) {
  if (const DeviceMemory* m = device_memory(device_); m && device_ != Device::cpu)
    return m->release(ptr, pool_ == Pool::host);
  if (holds_data(device_)) std::free(ptr);
}

Allocator::Block Allocator::allocate(size_t bytes) {
  size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.num_allocs++;
  void* p = nullptr;
  // Reuse a cached block no more than 25% larger than asked for.
  auto it = cache_.lower_bound(size);
  if (it != cache_.end() && it->first <= size + size / 4) {
    size = it->first;
    p = it->second;
    cache_.erase(it);
  } else {
    if (limit_ && stats_.reserved + size > limit_) {
      // Give back the cache before declaring out-of-memory.
      flush_cache_locked();
      if (stats_.reserved + size > limit_)
        fail("out of memory on ", device_name(device_),
             pool_ == Pool::host ? " (host pool of offloaded states)" : "", ": allocating ", size,
             " bytes with ", stats_.allocated, " allocated and ", stats_.reserved,
             " reserved exceeds the limit of ", limit_, " bytes");
    }
    p = os_alloc(size);
    if (!p && !cache_.empty()) {
      // A device runtime out of memory: the cached blocks may be what it lacks.
      flush_cache_locked();
      p = os_alloc(size);
    }
    if (!p) out_of_device_memory(size);
    stats_.num_os_allocs++;
    stats_.reserved += size;
    if (stats_.reserved > stats_.peak_reserved) stats_.peak_reserved = stats_.reserved;
  }
  // ASan: the block's bytes past the request, and the cached blocks, are poisoned, so that a
  // kernel reading past its tensor or a tensor used after it was freed is reported, not hidden by
  // the rounding or the cache (as PyTorch's caching allocator hides them from compute-sanitizer).
  if (poisonable(device_, pool_)) {
    ASAN_UNPOISON_MEMORY_REGION(p, bytes);
    ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + bytes, size - bytes);
  }
  stats_.allocated += size;
  stats_.by_use[size_t(use_)] += size;
  if (stats_.allocated > stats_.peak_allocated) {
    stats_.peak_allocated = stats_.allocated;
    stats_.by_use_at_peak = stats_.by_use;
  }
  return Block{p, size, use_};
}

void Allocator::deallocate(Block block) {
  if (!block.ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  stats_.allocated -= block.size;
  stats_.by_use[size_t(block.use)] -= block.size;
  if (poisonable(device_, pool_)) ASAN_POISON_MEMORY_REGION(block.ptr, block.size);
  cache_.emplace(block.size, block.ptr);
}

AllocatorStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_allocated = stats_.allocated;
  stats_.by_use_at_peak = stats_.by_use;
  stats_.peak_reserved = stats_.reserved;
}

void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [s, q] : cache_) {
    os_free(q, s);
    stats_.reserved -= s;
  }
  cache_.clear();
}

void Allocator::flush_cache_locked() {
  stats_.num_cache_flushes++;
  for (auto& [s, q] : cache_) {
    os_free(q, s);
    stats_.reserved -= s;
  }
  cache_.clear();
}

void Allocator::out_of_device_memory(size_t size) const {
  size_t free = 0, total = 0;
  if (const DeviceMemory* m = device_memory(device_)) m->mem_info(&free, &total);
  fail("out of memory on ", device_name(device_),
       pool_ == Pool::host ? " (pinned host memory of offloaded states)" : "", ": allocating ",
       size, " bytes for ", memory_use_name(use_), " with ", stats_.allocated, " allocated and ",
       stats_.reserved, " reserved by loom; the device has ", free, " of ", total, " bytes free");
}

void Allocator::set_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  limit_ = bytes;
}

size_t Allocator::limit() const {
  std::lock_guard<std::mutex> lock(mu_);
  return limit_;
}

}  // namespace loom
