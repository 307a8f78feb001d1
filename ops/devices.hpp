#pragma once
// What the layers above ops/ may ask of the devices (train/, apps/): whether this loom has the
// CUDA backend and a GPU it can use, and starting the process's GPU. The one place outside the
// backends that knows a device runtime exists; nothing here runs a kernel.
#include <cstdint>
#include <map>
#include <string>

#include "core/device.hpp"
#include "core/dtype.hpp"

namespace loom::ops {

struct GpuAvailability {
  bool built = false;        // this loom has the CUDA backend
  bool usable = false;       // ... and a driver and a GPU it can use
  int count = 0;             // GPUs found
  std::string name;          // GPU 0's name
  std::string why_not;       // when not usable: what was found
  std::string flash_blocks;  // built: the flash attention kernels' block sizes and why
};
GpuAvailability gpu_availability();
// Makes GPU `index` this process's device (the rank's local rank, modulo the GPUs there are:
// several ranks may share one GPU), its float32 GEMMs exact or, with `allow_tf32`, in TF32.
// Throws naming what is missing.
void start_gpu(int index, bool allow_tf32);
// A command line's --device: "cpu"; "cuda", GPU 0 started (an error naming what is missing where
// none is usable); "auto", cuda where a GPU is usable, else cpu. `key` names the option in errors.
Device start_device(const std::string& name, const char* key = "--device");

// The times this process's host has waited for its GPU, by what waited (cuda::host_waits: the
// step's loss read, the gradient norm, MoE's counts...); empty without the CUDA backend.
std::map<std::string, uint64_t> gpu_host_waits();

// The GEMM rate (FLOP/s) of `device` measured now for about `seconds`: the CPU's for `dtype`
// (cpu::measure_gemm_peak), a GPU's bf16 tensor-core rate whatever `dtype` (the denominator of MFU
// there, as in published GPU runs).
double measure_gemm_peak(Device device, DType dtype, double seconds);

// How the CPU runs bf16 GEMMs, for mixed_precision_param = "auto" and the startup lines.
struct CpuBf16Gemms {
  bool onednn_native = false;  // oneDNN has bf16 matmul instructions here (AVX512_BF16 or AMX)
  bool native = false;         // loom's bf16 GEMMs run as bf16 (not widened to f32)
  std::string onednn;          // oneDNN's effective ISA, e.g. "avx512_core_bf16"
  std::string path;            // which path they take and why (cpu::gemm_bf16_path)
};
CpuBf16Gemms cpu_bf16_gemms();

}  // namespace loom::ops
