#pragma once
// The CUDA emulation's stand-in for CUB's DeviceScan::ExclusiveSum (tests/cuda_emu/device.hpp):
// the same contract on host memory (a first call without scratch names the scratch it needs).
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>
#include <vector>

namespace cub {

struct DeviceScan {
  template <class In, class Out, class N>
  static cudaError_t ExclusiveSum(void* temp, size_t& temp_bytes, In in, Out out, N num_items,
                                  cudaStream_t = nullptr) {
    if (!temp) {
      temp_bytes = 512;
      return cudaSuccess;
    }
    if (temp_bytes < 512) return cudaErrorInvalidValue;
    using T = std::remove_cvref_t<decltype(in[0])>;
    std::vector<T> v(in, in + num_items);  // in and out may be the same array
    T sum{};
    for (N i = 0; i < num_items; ++i) {
      out[i] = sum;
      sum = T(sum + v[size_t(i)]);
    }
    return cudaSuccess;
  }
};

}  // namespace cub
