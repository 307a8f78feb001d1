#include "core/dtype.hpp"

#include "core/error.hpp"

namespace loom {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
    case DType::f64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::f64:
      return "float64";
  }
  return "?";
}

DType dtype_from_name(std::string_view n) {
  if (n == "float32" || n == "f32" || n == "F32") return DType::f32;
  if (n == "bfloat16" || n == "bf16" || n == "BF16") return DType::bf16;
  if (n == "int32" || n == "i32" || n == "I32") return DType::i32;
  if (n == "int64" || n == "i64" || n == "I64") return DType::i64;
  if (n == "float64" || n == "f64" || n == "F64") return DType::f64;
  fail("unknown dtype '", n, "': expected float32, bfloat16, int32, int64 or float64");
}

}  // namespace loom
