#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011). A value depends only on
// (key, counter), so the element i of a parameter gets the same value however the parameter is
// sliced across ranks (docs/design.md decision 2).
#include <array>
#include <cstdint>
#include <string_view>

namespace loom {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Key of a named parameter under a seed: a hash of both.
uint64_t philox_key(uint64_t seed, std::string_view name);

// out[i] = N(mean, std) sample number (first + i) of stream `key`.
void philox_normal(uint64_t key, int64_t first, int64_t count, float mean, float std, float* out);
// out[i] = U[0, 1) sample number (first + i) of stream `key`.
void philox_uniform(uint64_t key, int64_t first, int64_t count, float* out);

}  // namespace loom
