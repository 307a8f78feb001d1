#include "apps/gpu_info.hpp"

#include <cstdio>
#include <fstream>

#include "core/error.hpp"

#ifdef LOOM_CUDA_BACKEND
#include "kernels/cuda/measure.hpp"
#include "kernels/cuda/runtime.hpp"
#endif

namespace loom {

#ifdef LOOM_CUDA_BACKEND
namespace {

// The kernel module's own version ("580.159.04"), which the CUDA runtime does not report.
std::string nvidia_driver_version() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(f, line)) return "";
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue ..."
  const size_t k = line.find("Kernel Module");
  if (k == std::string::npos) return "";
  size_t b = line.find_first_not_of(' ', k + 13);
  size_t e = line.find(' ', b);
  return b == std::string::npos ? "" : line.substr(b, e - b);
}

}  // namespace
#endif

GpuSystemInfo collect_gpu_info([[maybe_unused]] double peak_seconds) {
  GpuSystemInfo g;
#ifdef LOOM_CUDA_BACKEND
  g.built = true;
  const cuda::RuntimeInfo& r = cuda::probe();
  const std::string module = nvidia_driver_version();
  g.backend =
      str_cat("CUDA runtime ", cuda::cuda_version_str(r.runtime_version), " (static), cuBLASLt ",
              cuda::cublaslt_version_str(r.cublaslt_version), "; driver ",
              r.driver_version ? str_cat(module.empty() ? "" : module + ", ", "CUDA ",
                                         cuda::cuda_version_str(r.driver_version))
                               : std::string("none"));
  if (!r.usable) {
    g.none = r.why_not;
    return g;
  }
  for (const cuda::Gpu& d : r.gpus) {
    char line[256];
    std::snprintf(line, sizeof line, "%d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB, bus %s",
                  d.index, d.name.c_str(), d.major, d.minor, d.sms,
                  double(d.memory_bytes) / double(1 << 30), double(d.l2_bytes) / double(1 << 20),
                  d.pci_bus_id.c_str());
    g.gpus.push_back(line);
  }
  if (peak_seconds > 0) {
    cuda::start(0);
    g.peak_bf16 = cuda::measure_gemm_peak_bf16(peak_seconds);
    g.copy_bandwidth = cuda::measure_copy_bandwidth(peak_seconds);
  }
#else
  g.none = "this loom was built without the CUDA backend (LOOM_CUDA=OFF, or no CUDA toolkit)";
#endif
  return g;
}

std::string format_gpu_info(const GpuSystemInfo& g) {
  std::string s;
  if (g.built) s += str_cat("  gpu backend   ", g.backend, "\n");
  if (!g.none.empty()) return s + str_cat("  gpu           none: ", g.none, "\n");
  for (const std::string& line : g.gpus) s += str_cat("  gpu           ", line, "\n");
  if (g.peak_bf16 > 0) {
    char peaks[160];
    std::snprintf(peaks, sizeof peaks,
                  "  gpu peak      bf16 GEMM %.1f TFLOP/s, device copy %.2f TB/s read + write "
                  "(measured on gpu 0)\n",
                  g.peak_bf16 / 1e12, g.copy_bandwidth / 1e12);
    s += peaks;
  }
  return s;
}

nlohmann::json gpu_info_json(const GpuSystemInfo& g) {
  return {{"cuda_backend", g.built},
          {"backend", g.backend},
          {"none", g.none},
          {"gpus", g.gpus},
          {"gemm_peak_bf16_flops", g.peak_bf16},
          {"copy_bandwidth_bytes_per_s", g.copy_bandwidth}};
}

}  // namespace loom
