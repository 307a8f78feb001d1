#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace loom {

enum class DType : uint8_t { f32, bf16, i32, i64, f64 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);          // "float32", "bfloat16", "int32", "int64", "float64"
DType dtype_from_name(std::string_view name);  // accepts the names above and "f32"/"bf16"/"i32"

// bfloat16 stored as its 16 raw bits; conversion rounds to nearest even (NaN stays NaN).
struct bf16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// An element of a kernel templated on its storage read as f32 and written from f32 (bf16: rounded
// to nearest even).
inline float load_f32(float v) {
  return v;
}
inline float load_f32(bf16 v) {
  return bf16_to_float(v);
}
inline void store_f32(float& dst, float v) {
  dst = v;
}
inline void store_f32(bf16& dst, float v) {
  dst = float_to_bf16(v);
}

}  // namespace loom
