#include "core/philox.hpp"

#include <cmath>

namespace loom {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t(M0) * c[0];
    uint64_t p1 = uint64_t(M1) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1],
         uint32_t(p0)};
    k[0] += W0;
    k[1] += W1;
  }
  return c;
}

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t philox_key(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return splitmix64(splitmix64(seed) ^ h);
}

static std::array<uint32_t, 4> draw(uint64_t key, int64_t index) {
  uint64_t i = static_cast<uint64_t>(index);
  return philox4x32({uint32_t(i), uint32_t(i >> 32), 0, 0}, {uint32_t(key), uint32_t(key >> 32)});
}

// (0, 1]: never 0, so log() is finite.
static double to_unit(uint32_t a, uint32_t b) {
  uint64_t v = (uint64_t(a) << 21) ^ uint64_t(b >> 11);
  return (double(v & ((1ull << 53) - 1)) + 1.0) / 9007199254740992.0;
}

void philox_normal(uint64_t key, int64_t first, int64_t count, float mean, float std, float* out) {
#pragma omp parallel for schedule(static) if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    auto r = draw(key, first + i);
    double u1 = to_unit(r[0], r[1]), u2 = to_unit(r[2], r[3]);
    double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    out[i] = static_cast<float>(mean + std * z);
  }
}

void philox_uniform(uint64_t key, int64_t first, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    auto r = draw(key, first + i);
    out[i] = static_cast<float>(to_unit(r[0], r[1]) - 0x1p-53);
  }
}

}  // namespace loom
