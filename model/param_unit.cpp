#include "model/param_unit.hpp"

#include <algorithm>

#include "core/philox.hpp"
#include "kernels/cpu/cast.hpp"

namespace loom {

ParamUnit::ParamUnit(std::string name, std::vector<ParamSpec> specs, bool bf16_mirror,
                     Device device)
    : name_(std::move(name)) {
  for (auto& s : specs) {
    Param p;
    p.offset = numel_;
    numel_ += shape_numel(s.shape);
    p.spec = std::move(s);
    params_.push_back(std::move(p));
  }
  flat_ = Tensor::empty({numel_}, DType::f32, device);
  grad_flat_ = Tensor::zeros({numel_}, DType::f32, device);
  if (bf16_mirror) flat_bf16_ = Tensor::empty({numel_}, DType::bf16, device);
  for (auto& p : params_) {
    int64_t n = shape_numel(p.spec.shape);
    p.value = flat_.narrow(0, p.offset, n).view(p.spec.shape);
    p.grad = grad_flat_.narrow(0, p.offset, n).view(p.spec.shape);
    if (bf16_mirror) p.value_bf16 = flat_bf16_.narrow(0, p.offset, n).view(p.spec.shape);
  }
}

const Param& ParamUnit::param(const std::string& name) const {
  for (auto& p : params_)
    if (p.spec.name == name) return p;
  fail("unit ", name_, " has no parameter ", name);
}

const void* ParamUnit::gemm_weights(size_t first) const {
  const Param& p = params_.at(first);
  return has_bf16() ? p.value_bf16.raw() : p.value.raw();
}

void ParamUnit::init_weights(uint64_t seed) {
  if (flat_.device() == Device::meta) return;
  for (auto& p : params_) {
    float* d = p.value.data<float>();
    int64_t n = p.value.numel();
    if (p.spec.init == Init::ones) {
      std::fill(d, d + n, 1.0f);
    } else {
      philox_normal(philox_key(seed, p.spec.name), 0, n, 0.0f, p.spec.std, d);
    }
  }
  refresh_bf16();
}

void ParamUnit::refresh_bf16() {
  if (!has_bf16() || flat_.device() == Device::meta) return;
  cpu::cast_f32_to_bf16(flat_.data<float>(), flat_bf16_.data<bf16>(), numel_);
}

void ParamUnit::zero_grad() {
  grad_flat_.zero_();
}

}  // namespace loom
