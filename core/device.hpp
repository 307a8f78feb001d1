#pragma once
#include <string_view>

namespace loom {

// meta: same allocator bookkeeping as a real device, no memory behind it, kernels do nothing.
enum class Device : unsigned char { cpu, cuda, meta };

std::string_view device_name(Device d);

}  // namespace loom
