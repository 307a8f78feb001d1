#include "ops/devices.hpp"

#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "kernels/cpu/gemm.hpp"

#ifdef LOOM_CUDA_BACKEND
#include "kernels/cuda/flash_attention.hpp"
#include "kernels/cuda/gemm.hpp"
#include "kernels/cuda/measure.hpp"
#include "kernels/cuda/runtime.hpp"
#endif

namespace loom::ops {

GpuAvailability gpu_availability() {
  GpuAvailability a;
#ifdef LOOM_CUDA_BACKEND
  const cuda::RuntimeInfo& r = cuda::probe();
  a.built = true;
  a.usable = r.usable;
  a.count = int(r.gpus.size());
  a.name = r.gpus.empty() ? "" : r.gpus[0].name;
  a.why_not = r.why_not;
  a.flash_blocks = cuda::flash_attention_blocks();
#else
  a.why_not = "this loom was built without the CUDA backend (LOOM_CUDA=OFF, or no CUDA toolkit)";
#endif
  return a;
}

void start_gpu([[maybe_unused]] int index, [[maybe_unused]] bool allow_tf32) {
#ifdef LOOM_CUDA_BACKEND
  const GpuAvailability a = gpu_availability();
  LOOM_CHECK(a.usable, "no GPU to use: ", a.why_not);
  cuda::start(index % a.count);
  cuda::set_allow_tf32(allow_tf32);
#else
  fail("no GPU to use: ", gpu_availability().why_not);
#endif
}

Device start_device(const std::string& name, const char* key) {
  LOOM_CHECK(name == "auto" || name == "cpu" || name == "cuda", key,
             ": expected auto, cpu or cuda, got '", name, "'");
  if (name == "cpu") return Device::cpu;
  const GpuAvailability g = gpu_availability();
  if (name == "auto" && !g.usable) return Device::cpu;
  LOOM_CHECK(g.usable, key, " cuda, but ", g.built ? "no GPU is usable: " : "", g.why_not);
  start_gpu(0, false);
  return Device::cuda;
}

CpuBf16Gemms cpu_bf16_gemms() {
  const cpu::CpuIsa& isa = cpu::cpu_isa();
  return {isa.onednn_native_bf16, cpu::gemm_bf16_native(), isa.onednn, cpu::gemm_bf16_path()};
}

std::map<std::string, uint64_t> gpu_host_waits() {
#ifdef LOOM_CUDA_BACKEND
  return cuda::host_waits();
#else
  return {};
#endif
}

double measure_gemm_peak(Device device, DType dtype, double seconds) {
#ifdef LOOM_CUDA_BACKEND
  if (device == Device::cuda) return cuda::measure_gemm_peak_bf16(seconds);
#endif
  LOOM_CHECK(device == Device::cpu, "measure_gemm_peak: no GEMM on device ", device_name(device));
  return cpu::measure_gemm_peak(dtype, seconds);
}

}  // namespace loom::ops
