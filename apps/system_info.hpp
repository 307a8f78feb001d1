#pragma once
// Where a run or a figure was taken: the header of `loom info` and of `loom bench`, one function
// for both so the two never disagree.
#include <string>

#include <nlohmann/json.hpp>

#include "apps/gpu_info.hpp"

namespace loom {

struct SystemInfo {
  std::string version;         // loom's version, e.g. "0.1.0"
  std::string commit;          // `git describe --always --dirty` at build time, or "unknown"
  std::string cpu_model;       // /proc/cpuinfo's model name
  std::string cpu_flags;       // the instruction-set flags that matter to loom
  std::string kernels;         // the tier loom's kernels run (cpu_isa.hpp)
  std::string requested;       // LOOM_CPU_ISA, or "native"
  std::string available;       // the tiers this CPU has, lowest first ("baseline avx2 avx512")
  std::string onednn_version;  // e.g. "2.6.3"
  std::string onednn_isa;      // oneDNN's effective ISA, e.g. "avx512_core_bf16"
  std::string bf16_gemm;       // gemm_bf16_path()
  std::string mpi;             // the MPI library's version line
  int threads = 0;             // OpenMP threads
  double peak_f32 = 0;         // measured GEMM FLOP/s (0: not measured)
  double peak_bf16 = 0;
  std::string load_average;  // /proc/loadavg's three figures
  GpuSystemInfo gpu;         // the CUDA backend and its GPUs (apps/gpu_info.hpp)
};

// Everything but the GEMM peaks (and the GPU's two ceilings), which take about `peak_seconds` each
// to measure (0: skipped, e.g. when several ranks share the cores).
SystemInfo collect_system_info(double peak_seconds);

// The header lines ("loom 0.1.0 (commit ...)\n  cpu ...\n"), each line prefixed by `indent`
// after the first.
std::string format_system_info(const SystemInfo& s);
nlohmann::json system_info_json(const SystemInfo& s);

// /proc/loadavg's 1, 5 and 15 minute load averages ("" where unreadable).
std::string load_average();

}  // namespace loom
