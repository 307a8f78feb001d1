#pragma once
// Communication buffers of tensor parallelism (docs/design.md decision 9): one buffer per
// (purpose, dtype, size), allocated on first use and handed out again on every later request,
// so the buffers of a step do not grow with the number of layers and are never allocated per
// call. A buffer is valid until the next request with the same key: purposes name uses that are
// never alive at the same time under the same key (the caller's contract). Buffers that must
// live from forward to backward are not taken from the pool.
#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "core/tensor.hpp"

namespace loom::dist {

class BufferPool {
 public:
  // A contiguous [numel] tensor of `dtype` for `purpose` (contents undefined).
  Tensor get(const std::string& purpose, DType dtype, int64_t numel, Device device = Device::cpu);
  size_t bytes() const;  // every buffer held
  size_t count() const { return buffers_.size(); }

 private:
  std::map<std::tuple<std::string, DType, int64_t>, Tensor> buffers_;
};

}  // namespace loom::dist
