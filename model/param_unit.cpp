#include "model/param_unit.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/philox.hpp"
#include "ops/ops.hpp"

namespace loom {

Shape ParamSpec::global_shape() const {
  Shape g = shape;
  if (split == TpSplit::rows) g[0] = global_rows > 0 ? global_rows : g[0] * tp_count;
  if (split == TpSplit::cols) g[1] *= tp_count;
  return g;
}

ParamUnit::ParamUnit(std::string name, std::vector<ParamSpec> specs, bool bf16_mirror,
                     Device device, ShardLayout shard)
    : name_(std::move(name)), device_(device), bf16_(bf16_mirror), shard_(shard) {
  LOOM_CHECK(shard_.count >= 1 && shard_.rank >= 0 && shard_.rank < shard_.count, "unit ", name_,
             ": shard rank ", shard_.rank, " of ", shard_.count,
             " (expected 0 <= rank < count, count >= 1)");
  for (auto& s : specs) {
    Param p;
    p.offset = numel_;
    numel_ += shape_numel(s.shape);
    side_offset_.push_back(s.f32_value ? side_numel_ : -1);
    if (s.f32_value) side_numel_ += shape_numel(s.shape);
    p.spec = std::move(s);
    params_.push_back(std::move(p));
  }
  padded_ = (numel_ + shard_.count - 1) / shard_.count * shard_.count;
  unwritten_.assign(params_.size(), 0);
  // The GEMMs read an unsharded unit's buffers in place, so it cannot live in host memory.
  LOOM_CHECK(!shard_.offload || device == Device::elsewhere || sharded(), "unit ", name_,
             ": CPU offload needs sharded states (FSDP over more than one rank)");
  if (sharded()) {
    const Pool pool = shard_.offload ? Pool::host : Pool::device;
    master_ = Tensor::zeros({shard_numel()}, DType::f32, device, pool);
    grad_shard_ = Tensor::zeros({shard_numel()}, DType::f32, device, pool);
    return;
  }
  flat_ = Tensor::empty({numel_}, DType::f32, device);
  grad_flat_ = Tensor::zeros({numel_}, DType::f32, device);
  if (bf16_mirror) flat_bf16_ = Tensor::empty({numel_}, DType::bf16, device);
  bind_views();
}

void ParamUnit::bind_views() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    const int64_t n = shape_numel(p.spec.shape);
    p.value = p.value_bf16 = p.grad = Tensor();
    if (flat_.defined()) {
      p.value = flat_.narrow(0, p.offset, n).view(p.spec.shape);
    } else if (side_.defined() && side_offset_[i] >= 0) {
      p.value = side_.narrow(0, side_offset_[i], n).view(p.spec.shape);
    }
    if (flat_bf16_.defined()) p.value_bf16 = flat_bf16_.narrow(0, p.offset, n).view(p.spec.shape);
    if (grad_flat_.defined()) p.grad = grad_flat_.narrow(0, p.offset, n).view(p.spec.shape);
  }
}

const Param& ParamUnit::param(const std::string& name) const {
  for (auto& p : params_)
    if (p.spec.name == name) return p;
  fail("unit ", name_, " has no parameter ", name);
}

const void* ParamUnit::gemm_weights(size_t first) const {
  return gemm_weight(first).raw();
}

const Tensor& ParamUnit::gemm_weight(size_t first) const {
  const Param& p = params_.at(first);
  LOOM_CHECK(weights_materialized(), "unit ", name_,
             ": weights read while released (a missing materialize before forward/backward)");
  return has_bf16() ? p.value_bf16 : p.value;
}

std::vector<ShardSlice> ParamUnit::shard_slices() const {
  std::vector<ShardSlice> out;
  const int64_t lo = shard_begin(), hi = lo + shard_numel();
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t b = std::max(lo, params_[i].offset);
    const int64_t e = std::min(hi, params_[i].offset + shape_numel(params_[i].spec.shape));
    if (b < e) out.push_back({i, b - params_[i].offset, e - b, b - lo});
  }
  return out;
}

void ParamUnit::init_weights(uint64_t seed) {
  Tensor& master = master_shard();
  for (const ShardSlice& s : shard_slices()) {
    const ParamSpec& spec = params_[s.param].spec;
    Tensor out = master.narrow(0, s.shard_offset, s.count);
    if (spec.init == Init::ones) {
      ops::fill(out, 1.0f);
    } else {
      // Sample (global element index) of the parameter's stream: the same value on every layout.
      const auto key = philox_key(seed, spec.name);
      const int64_t real = spec.global_numel();
      spec.for_global_runs(s.begin, s.count, [&](int64_t g, int64_t n, int64_t local) {
        // Padding rows stay zero: they are never predicted, and zero rows stay zero under AdamW.
        const int64_t keep = std::clamp<int64_t>(real - g, 0, n);
        Tensor run = out.narrow(0, local - s.begin, keep);
        Tensor pad = out.narrow(0, local - s.begin + keep, n - keep);
        ops::philox_normal(run, key, g, spec.std);
        ops::fill(pad, 0.0f);
      });
    }
  }
  refresh_bf16();
}

void ParamUnit::refresh_bf16() {
  if (sharded() || !has_bf16()) return;
  ops::cast(flat_, flat_bf16_);
}

void ParamUnit::zero_grad() {
  if (sharded()) {
    // The shard receives sums (reduce-scatters), not GEMM writes; a full gradient still held is
    // zeroed whole.
    grad_shard().zero_();
    if (grad_flat_.defined()) grad_flat_.zero_();
    std::fill(unwritten_.begin(), unwritten_.end(), uint8_t{0});
    return;
  }
  mark_grads_unwritten();
}

void ParamUnit::mark_grads_unwritten() {
  // Zeros between the gemm_grad parameters (and over the padding), which are marked instead.
  int64_t zero_from = 0;
  const auto zero_to = [&](int64_t end) {
    if (end > zero_from) grad_flat_.narrow(0, zero_from, end - zero_from).zero_();
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (!p.spec.gemm_grad) continue;
    zero_to(p.offset);
    zero_from = p.offset + shape_numel(p.spec.shape);
    unwritten_[i] = 1;
  }
  zero_to(grad_flat_.numel());
}

ops::WeightGrad ParamUnit::weight_grad(size_t first, size_t count) {
  LOOM_CHECK(first + count <= params_.size() && count > 0, "unit ", name_, ": weight_grad(", first,
             ", ", count, ") of ", params_.size(), " parameters");
  for (size_t i = first; i < first + count; ++i)
    LOOM_CHECK(params_[i].spec.gemm_grad == params_[first].spec.gemm_grad, "unit ", name_,
               ": the fused gradient of ", params_[first].spec.name, " mixes gemm_grad parameters ",
               "with others (", params_[i].spec.name, ")");
  return {params_[first].grad, std::span<uint8_t>(unwritten_.data() + first, count)};
}

void ParamUnit::check_grads_written() const {
  for (size_t i = 0; i < params_.size(); ++i)
    LOOM_CHECK(!unwritten_[i], "unit ", name_, ": the gradient of ", params_[i].spec.name,
               " was never written after zero_grad (its values are stale, not zero): its weight ",
               "gradient must run in every backward that a step reads");
}

DType ParamUnit::gather_dtype() const {
  if (!bf16_) return DType::f32;
  // A unit that is mostly read as f32 (the embedding table) is cheaper to gather in f32 once
  // than in bf16 plus an f32 side buffer of nearly the same size.
  return 2 * side_numel_ > numel_ ? DType::f32 : DType::bf16;
}

void ParamUnit::materialize_weights() {
  if (!sharded() || full_.defined()) return;
  const MemoryUseScope use(device_, MemoryUse::gathered);
  full_ = Tensor::empty({padded_}, gather_dtype(), device_);
  if (gather_dtype() == DType::f32) {
    flat_ = full_.narrow(0, 0, numel_);
    if (bf16_) flat_bf16_ = Tensor::empty({numel_}, DType::bf16, device_);
  } else {
    flat_bf16_ = full_.narrow(0, 0, numel_);
    if (needs_side()) side_ = Tensor::empty({side_numel_}, DType::f32, device_);
  }
  bind_views();
}

size_t ParamUnit::materialized_weight_bytes() const {
  if (!sharded()) return 0;
  size_t bytes = size_t(padded_) * dtype_size(gather_dtype());
  if (gather_dtype() == DType::f32 && bf16_) bytes += size_t(numel_) * 2;
  if (needs_side()) bytes += size_t(side_numel_) * 4;
  return bytes;
}

void ParamUnit::release_weights() {
  if (!sharded()) return;
  full_ = flat_ = flat_bf16_ = side_ = Tensor();
  bind_views();
}

void ParamUnit::materialize_grads() {
  if (!sharded() || grad_flat_.defined()) return;
  const MemoryUseScope use(device_, MemoryUse::gathered);
  grad_flat_ = Tensor::empty({padded_}, DType::f32, device_);
  bind_views();
  mark_grads_unwritten();
}

void ParamUnit::release_grads() {
  if (!sharded()) return;
  grad_flat_ = Tensor();
  bind_views();
}

Tensor ParamUnit::gather_input() {
  LOOM_CHECK(sharded() && full_.defined(), "unit ", name_,
             ": gather_input needs a sharded unit with materialized weights");
  // ops::copy: with the shard offloaded this is the host-to-device transfer the time model prices.
  Tensor block = full_.narrow(0, shard_begin(), shard_numel());
  ops::copy(master_, block);
  if (needs_side()) {
    side_.zero_();
    for (const ShardSlice& s : shard_slices())
      if (side_offset_[s.param] >= 0) {
        Tensor dst = side_.narrow(0, side_offset_[s.param] + s.begin, s.count);
        ops::copy(master_.narrow(0, s.shard_offset, s.count), dst);
      }
  }
  return block;
}

void ParamUnit::finish_gather() {
  if (!sharded()) return;
  if (bf16_ && full_.dtype() == DType::f32) ops::cast(flat_, flat_bf16_);
}

}  // namespace loom
