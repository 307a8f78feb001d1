// libFuzzer harness: a safetensors file (8-byte header length, JSON header, data) opened by
// SafetensorsFile, then every float tensor read as f32.
#include <cstdint>
#include <string_view>
#include <vector>

#include "model/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path =
      loom::fuzz::write_file("model.safetensors", {reinterpret_cast<const char*>(data), size});
  loom::fuzz::expect_loom_errors_only([&] {
    loom::SafetensorsFile f(path);
    for (const auto& e : f.entries()) {
      (void)f.data(e.name);
      if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16") continue;
      int64_t n = 1;
      for (int64_t d : e.shape) n *= d;
      if (n > (1 << 20)) continue;
      std::vector<float> out(size_t(n) + 1);
      f.read_f32(e.name, e.shape, out.data());
    }
    for (const auto& kv : f.metadata()) (void)kv;
  });
  return 0;
}
