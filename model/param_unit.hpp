#pragma once
// Parameters are grouped into units (one per transformer block, one for the embedding, one for
// the final norm + output head): the FSDP unit of DESIGN.md decision 3. A unit owns one flat f32
// buffer of master weights, one flat f32 gradient buffer and, with bf16 mixed precision, a flat
// bf16 mirror that the GEMMs read. Each parameter is a view at an offset in those buffers, so
// adjacent parameters (q, k, v; gate, up) can be read as one fused matrix.
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace loom {

enum class Init { normal, ones };

struct ParamSpec {
  std::string name;  // global Hugging Face name
  Shape shape;
  Init init = Init::normal;
  float std = 0.02f;
  bool decay = true;  // weight decay applies (not to norms)
};

struct Param {
  ParamSpec spec;
  int64_t offset = 0;  // in elements, within the unit's flat buffers
  Tensor value;        // f32 master weights (view)
  Tensor grad;         // f32 gradient (view)
  Tensor value_bf16;   // bf16 mirror (view; undefined without bf16 mixed precision)
};

class ParamUnit {
 public:
  ParamUnit(std::string name, std::vector<ParamSpec> specs, bool bf16_mirror, Device device);

  const std::string& name() const { return name_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  const Param& param(const std::string& name) const;
  int64_t numel() const { return numel_; }

  Tensor& flat() { return flat_; }
  Tensor& grad_flat() { return grad_flat_; }
  Tensor& flat_bf16() { return flat_bf16_; }
  bool has_bf16() const { return flat_bf16_.defined(); }

  // The weights a GEMM reads, starting at parameter `first` (adjacent parameters with the same
  // number of columns read as one fused matrix): the bf16 mirror if there is one, else f32.
  const void* gemm_weights(size_t first) const;
  float* grad_data(size_t first) { return params_[first].grad.data<float>(); }

  void init_weights(uint64_t seed);  // Philox, a function of (seed, name, element index)
  void refresh_bf16();               // mirror <- round(master)
  void zero_grad();

 private:
  std::string name_;
  std::vector<Param> params_;
  int64_t numel_ = 0;
  Tensor flat_, grad_flat_, flat_bf16_;
};

}  // namespace loom
