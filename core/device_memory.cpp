#include "core/device_memory.hpp"

#include <array>
#include <atomic>

#include "core/error.hpp"

namespace loom {

namespace {
// Written once per device before its first allocation, read on every allocation after.
std::array<std::atomic<const DeviceMemory*>, 4> g_memory{};
}  // namespace

void register_device_memory(Device device, const DeviceMemory& m) {
  LOOM_CHECK(m.reserve && m.release && m.mem_info && m.zero && m.copy,
             "register_device_memory: device ", device_name(device), ": a function is missing");
  // Lives for the process: allocators of the device hold blocks until the process ends.
  static std::array<DeviceMemory, 4> kept{};
  const size_t i = size_t(device);
  kept[i] = m;
  g_memory[i].store(&kept[i]);
}

const DeviceMemory* device_memory(Device device) {
  return g_memory[size_t(device)].load();
}

}  // namespace loom
