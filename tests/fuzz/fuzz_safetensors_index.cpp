// libFuzzer harness: a model.safetensors.index.json beside two valid shards, read by
// SafetensorsDir (weight_map -> file, each file opened and checked to hold the tensor).
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/tensor.hpp"
#include "model/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

namespace {

std::string model_dir() {
  static const std::string dir = [] {
    const std::string d = loom::fuzz::scratch_dir() + "/model";
    std::filesystem::create_directories(d);
    auto t = [](const char* name, int64_t n) {
      loom::Tensor x = loom::Tensor::zeros({n}, loom::DType::f32);
      return loom::NamedTensor{name, x};
    };
    loom::write_safetensors(d + "/model-00001-of-00002.safetensors", {t("a.weight", 4)});
    loom::write_safetensors(d + "/model-00002-of-00002.safetensors",
                            {t("b.weight", 2), t("c.weight", 3)});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = model_dir();
  {
    std::ofstream f(dir + "/model.safetensors.index.json", std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  loom::fuzz::expect_loom_errors_only([&] {
    loom::SafetensorsDir d(dir);
    for (const std::string& n : d.names()) {
      const auto& e = d.file_of(n).entry(n);
      int64_t count = 1;
      for (int64_t x : e.shape) count *= x;
      std::vector<float> out(size_t(count) + 1);
      d.read_f32(n, e.shape, out.data());
    }
  });
  return 0;
}
