#include "distributed/buffer_pool.hpp"

namespace loom::dist {

Tensor BufferPool::get(BufferPurpose purpose, DType dtype, int64_t numel, Device device) {
  Tensor& t = buffers_[{purpose, dtype, numel}];
  if (!t.defined()) t = Tensor::empty({numel}, dtype, device);
  return t;
}

size_t BufferPool::bytes() const {
  size_t n = 0;
  for (const auto& [key, t] : buffers_) n += t.nbytes();
  return n;
}

}  // namespace loom::dist
