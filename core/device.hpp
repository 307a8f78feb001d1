#pragma once
#include <string_view>

namespace loom {

// meta: same allocator bookkeeping as a real device, no memory behind it, kernels do nothing
//   (`loom plan` runs a rank's real step on it).
// elsewhere: a tensor another rank holds (a pipeline rank's units of other stages): its name and
//   shape for bookkeeping, no memory; booked by its own allocator, apart from this rank's devices,
//   and never given to a kernel.
enum class Device : unsigned char { cpu, cuda, meta, elsewhere };

std::string_view device_name(Device d);
// Whether a tensor on `d` has memory behind it that can be read and written.
inline bool holds_data(Device d) {
  return d == Device::cpu || d == Device::cuda;
}

}  // namespace loom
