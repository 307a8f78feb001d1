#include "core/tensor.hpp"

#include "core/device_memory.hpp"

#include <cstring>
#include <sstream>

namespace loom {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

Storage::Storage(Device device, Pool pool, size_t bytes)
    : device_(device),
      pool_(pool),
      bytes_(bytes),
      block_(Allocator::get(device, pool).allocate(bytes)) {}

Storage::~Storage() {
  Allocator::get(device_, pool_).deallocate(block_);
}

static Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, Pool pool) {
  for (auto d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.storage_ = std::make_shared<Storage>(device, pool, shape_numel(shape) * dtype_size(dtype));
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, Pool pool) {
  Tensor t = empty(shape, dtype, device, pool);
  t.zero_();
  return t;
}

int64_t Tensor::size(int64_t dim) const {
  if (dim < 0) dim += ndim();
  LOOM_CHECK(dim >= 0 && dim < ndim(), "dimension ", dim, " out of range for shape ",
             shape_str(shape_));
  return shape_[dim];
}

bool Tensor::is_contiguous() const {
  return strides_ == contiguous_strides(shape_);
}

void* Tensor::raw() const {
  LOOM_CHECK(storage_, "use of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * dtype_size(dtype_);
}

void Tensor::check_type(size_t elem) const {
  LOOM_CHECK(elem == dtype_size(dtype_), "tensor of dtype ", dtype_name(dtype_),
             " accessed with an element type of ", elem, " bytes");
}

Tensor Tensor::view(const Shape& shape) const {
  LOOM_CHECK(is_contiguous(), "view of a non-contiguous tensor ", shape_str(shape_));
  LOOM_CHECK(shape_numel(shape) == numel(), "cannot view ", shape_str(shape_), " as ",
             shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

Tensor Tensor::narrow(int64_t dim, int64_t start, int64_t len) const {
  if (dim < 0) dim += ndim();
  LOOM_CHECK(dim >= 0 && dim < ndim() && start >= 0 && len >= 0 && start + len <= shape_[dim],
             "narrow(", dim, ", ", start, ", ", len, ") out of range for shape ",
             shape_str(shape_));
  Tensor t = *this;
  t.offset_ += start * strides_[dim];
  t.shape_[dim] = len;
  return t;
}

Tensor Tensor::squeeze0() const {
  Tensor t = *this;
  t.shape_.erase(t.shape_.begin());
  t.strides_.erase(t.strides_.begin());
  return t;
}

void Tensor::zero_() {
  LOOM_CHECK(is_contiguous(), "zero_ of a non-contiguous tensor");
  if (!holds_data(device()) || numel() == 0) return;
  if (device() == Device::cpu) return void(std::memset(raw(), 0, nbytes()));
  device_memory(device())->zero(raw(), nbytes());
}

void Tensor::copy_from(const Tensor& src) {
  LOOM_CHECK(shape_ == src.shape_ && dtype_ == src.dtype_, "copy_from: ", shape_str(src.shape_),
             " ", dtype_name(src.dtype_), " into ", shape_str(shape_), " ", dtype_name(dtype_));
  LOOM_CHECK(is_contiguous() && src.is_contiguous(), "copy_from needs contiguous tensors");
  if (!holds_data(device()) || !holds_data(src.device()) || numel() == 0) return;
  if (device() == Device::cpu && src.device() == Device::cpu)
    return void(std::memcpy(raw(), src.raw(), nbytes()));
  // Between host and device, or on one device: its runtime copies (in stream order).
  const bool to_device = device() != Device::cpu, from_device = src.device() != Device::cpu;
  device_memory(to_device ? device() : src.device())
      ->copy(raw(), src.raw(), nbytes(), to_device, from_device);
}

Tensor Tensor::on_host() const {
  if (device() == Device::cpu) return *this;
  Tensor h = empty(shape_, dtype_, Device::cpu);
  h.copy_from(*this);
  return h;
}

Tensor Tensor::to(DType dtype) const {
  LOOM_CHECK(is_contiguous(), "to() of a non-contiguous tensor");
  LOOM_CHECK(device() != Device::cuda || dtype == dtype_,
             "to(): a dtype conversion on the GPU is ops::cast, not Tensor::to");
  Tensor out = empty(shape_, dtype, device());
  if (!holds_data(device())) return out;
  int64_t n = numel();
  if (dtype == dtype_) {
    out.copy_from(*this);
  } else if (dtype_ == DType::f32 && dtype == DType::bf16) {
    const float* s = data<float>();
    bf16* d = out.data<bf16>();
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
  } else if (dtype_ == DType::bf16 && dtype == DType::f32) {
    const bf16* s = data<bf16>();
    float* d = out.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
  } else {
    fail("no conversion from ", dtype_name(dtype_), " to ", dtype_name(dtype));
  }
  return out;
}

}  // namespace loom
