#pragma once
// The GPU lines of `loom info` and `loom bench`: the CUDA backend's runtime, driver and library
// versions, each GPU, and the two ceilings measured now (bf16 GEMM, device copy). A loom built
// without the backend says so.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom {

struct GpuSystemInfo {
  bool built = false;             // this loom has the CUDA backend
  std::string backend;            // runtime, cuBLASLt and driver versions
  std::string none;               // where no GPU can be used: why
  std::vector<std::string> gpus;  // one line each
  double peak_bf16 = 0;           // measured on GPU 0 (0: not measured)
  double copy_bandwidth = 0;
};

// Measures the ceilings on GPU 0 for about `peak_seconds` each (0: skipped).
GpuSystemInfo collect_gpu_info(double peak_seconds);
// Lines in the style of format_system_info ("  gpu ...\n").
std::string format_gpu_info(const GpuSystemInfo& g);
nlohmann::json gpu_info_json(const GpuSystemInfo& g);

}  // namespace loom
