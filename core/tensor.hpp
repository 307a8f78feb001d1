#pragma once
// A Tensor is a view (shape, strides, element offset) of a reference-counted Storage that owns
// one allocator block. Tensors are cheap to copy; copies share storage.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace loom {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

class Storage {
 public:
  Storage(Device device, Pool pool, size_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return block_.ptr; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  Pool pool() const { return pool_; }

 private:
  Device device_;
  Pool pool_;
  size_t bytes_;
  Allocator::Block block_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu,
                      Pool pool = Pool::device);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu,
                      Pool pool = Pool::device);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu; }
  Pool pool() const { return storage_ ? storage_->pool() : Pool::device; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t dim) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  void* raw() const;
  template <class T>
  T* data() const {
    check_type(sizeof(T));
    return static_cast<T*>(raw());
  }

  // Views sharing storage.
  Tensor view(const Shape& shape) const;                         // contiguous only
  Tensor narrow(int64_t dim, int64_t start, int64_t len) const;  // a slice along one dim
  Tensor operator[](int64_t i) const { return narrow(0, i, 1).squeeze0(); }

  void zero_();
  void copy_from(const Tensor& src);  // same shape and dtype, both contiguous
  Tensor to(DType dtype) const;       // converting copy (f32 <-> bf16)
  // This tensor where its memory is the host's (cpu), else a contiguous host copy of it (what a
  // checkpoint writes from a GPU, or reads into before copy_from puts it back).
  Tensor on_host() const;

 private:
  Tensor squeeze0() const;
  void check_type(size_t elem) const;

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_, strides_;
  DType dtype_ = DType::f32;
};

// An uninitialized float32 tensor on `device`: the scratch of the blocks' forwards and backwards.
inline Tensor f32(const Shape& shape, Device device) {
  return Tensor::empty(shape, DType::f32, device);
}

}  // namespace loom
