#pragma once
// How a device's memory is reserved from its runtime, given back, zeroed and copied. core/ knows
// no device runtime (it includes std only): a backend registers these functions for its device
// (the CUDA backend for Device::cuda, kernels/cuda/runtime.cpp) and the Allocator and Tensor go
// through them. The cpu device needs none (host memory), meta and elsewhere have no memory.
#include <cstddef>

#include "core/device.hpp"

namespace loom {

struct DeviceMemory {
  // A block of `bytes` of the device's own memory (pinned host memory when `host`, the pool of
  // offloaded states), or nullptr when the runtime has none left.
  void* (*reserve)(size_t bytes, bool host) = nullptr;
  void (*release)(void* p, bool host) = nullptr;
  // Bytes the device has free now, and its capacity (for an out-of-memory message).
  void (*mem_info)(size_t* free, size_t* total) = nullptr;
  // Work on the device's stream, in the order of the calls: dst = 0, and dst = src where one or
  // both sides are on the device (`to_device`, `from_device` say which).
  void (*zero)(void* dst, size_t bytes) = nullptr;
  void (*copy)(void* dst, const void* src, size_t bytes, bool to_device,
               bool from_device) = nullptr;
  // The device's memory is host memory the CPU may touch (the CUDA backend's host emulation,
  // tests/cuda_emu/): under AddressSanitizer the Allocator then poisons what no tensor owns.
  bool host_addressable = false;
};

// Registers the functions of `device`'s runtime (once, before its first allocation).
void register_device_memory(Device device, const DeviceMemory& m);
// The registered functions of `device`, or nullptr where none are (a build or a run without that
// device's backend).
const DeviceMemory* device_memory(Device device);

}  // namespace loom
