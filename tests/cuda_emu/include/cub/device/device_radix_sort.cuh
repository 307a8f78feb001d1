#pragma once
// The CUDA emulation's stand-in for CUB's DeviceRadixSort (tests/cuda_emu/device.hpp): the same
// contract on host memory. Called with no scratch, it names the scratch it needs (as CUB, a
// nonzero size the caller must provide); then a stable sort of the pairs by the key bits
// [begin_bit, end_bit), which is what CUB's LSD radix sort yields. Bits of a key outside the range
// are ignored as CUB ignores them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace cub {

struct DeviceRadixSort {
  template <class K, class V, class N>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out,
                               const V* values_in, V* values_out, N num_items, int begin_bit = 0,
                               int end_bit = int(sizeof(K) * 8), cudaStream_t = nullptr) {
    const size_t n = size_t(num_items);
    if (!temp) {
      temp_bytes = 2 * n * (sizeof(K) + sizeof(V)) + 256;
      return cudaSuccess;
    }
    if (temp_bytes < 2 * n * (sizeof(K) + sizeof(V)) + 256) return cudaErrorInvalidValue;
    std::fill_n(static_cast<char*>(temp), temp_bytes, char(0x5a));  // CUB's scratch: garbage
    const uint64_t width = uint64_t(end_bit - begin_bit);
    const uint64_t mask = width >= 64 ? ~uint64_t(0) : (uint64_t(1) << width) - 1;
    auto digit = [&](size_t i) { return (uint64_t(keys_in[i]) >> begin_bit) & mask; };
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return digit(a) < digit(b); });
    std::vector<K> k(n);
    std::vector<V> v(n);
    for (size_t i = 0; i < n; ++i) k[i] = keys_in[order[i]], v[i] = values_in[order[i]];
    std::copy(k.begin(), k.end(), keys_out);
    std::copy(v.begin(), v.end(), values_out);
    return cudaSuccess;
  }
};

}  // namespace cub
