#include "apps/system_info.hpp"

#include <omp.h>

#include <cstdio>
#include <fstream>
#include <oneapi/dnnl/dnnl.hpp>

#include "core/error.hpp"
#include "distributed/mpi_info.hpp"
#include "kernels/cpu/cpu_isa.hpp"
#include "kernels/cpu/gemm.hpp"
#include "loom_git_version.h"

#ifndef LOOM_VERSION
#define LOOM_VERSION "unknown"
#endif

namespace loom {

std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  if (!(f >> a >> b >> c)) return "";
  return a + " " + b + " " + c;
}

SystemInfo collect_system_info(double peak_seconds) {
  SystemInfo s;
  s.version = LOOM_VERSION;
  s.commit = LOOM_GIT_DESCRIBE;
  const cpu::CpuIsa& isa = cpu::cpu_isa();
  s.cpu_model = cpu::cpu_model_name();
  s.cpu_flags = cpu::cpu_flags_summary();
  s.kernels = cpu::isa_name(isa.kernels);
  s.requested = isa.requested;
  for (cpu::Isa t : isa.available)
    s.available += str_cat(s.available.empty() ? "" : " ", cpu::isa_name(t));
  const dnnl_version_t* v = dnnl_version();
  s.onednn_version = str_cat(v->major, ".", v->minor, ".", v->patch);
  s.onednn_isa = isa.onednn;
  s.bf16_gemm = cpu::gemm_bf16_path();
  s.mpi = dist::mpi_library_version();
  s.threads = omp_get_max_threads();
  if (peak_seconds > 0) {
    s.peak_f32 = cpu::measure_gemm_peak(DType::f32, peak_seconds);
    s.peak_bf16 = cpu::measure_gemm_peak(DType::bf16, peak_seconds);
  }
  s.load_average = load_average();
  s.gpu = collect_gpu_info(peak_seconds);
  return s;
}

std::string format_system_info(const SystemInfo& s) {
  char peaks[128] = "not measured (several ranks share the cores)";
  if (s.peak_f32 > 0)
    std::snprintf(peaks, sizeof peaks, "f32 %.1f GFLOP/s, bf16 %.1f GFLOP/s (measured)",
                  s.peak_f32 / 1e9, s.peak_bf16 / 1e9);
  return str_cat("loom ", s.version, " (commit ", s.commit, ")\n",                    //
                 "  cpu           ", s.cpu_model, "\n",                               //
                 "  cpu flags     ", s.cpu_flags, "\n",                               //
                 "  kernels       ", s.kernels, " (LOOM_CPU_ISA=", s.requested,       //
                 "; this CPU has ", s.available, ")\n",                               //
                 "  oneDNN        ", s.onednn_version, ", ISA ", s.onednn_isa, "\n",  //
                 "  bf16 GEMMs    ", s.bf16_gemm, "\n",                               //
                 "  MPI           ", s.mpi, "\n",                                     //
                 "  threads       ", s.threads, " (OpenMP)\n",                        //
                 "  GEMM peak     ", peaks, "\n",                                     //
                 "  load average  ", s.load_average.empty() ? "unknown" : s.load_average, "\n",
                 format_gpu_info(s.gpu));
}

nlohmann::json system_info_json(const SystemInfo& s) {
  return {{"version", s.version},
          {"commit", s.commit},
          {"cpu_model", s.cpu_model},
          {"cpu_flags", s.cpu_flags},
          {"kernels", s.kernels},
          {"requested", s.requested},
          {"available", s.available},
          {"onednn_version", s.onednn_version},
          {"onednn_isa", s.onednn_isa},
          {"bf16_gemm", s.bf16_gemm},
          {"mpi", s.mpi},
          {"threads", s.threads},
          {"gemm_peak_f32_flops", s.peak_f32},
          {"gemm_peak_bf16_flops", s.peak_bf16},
          {"load_average", s.load_average},
          {"gpu", gpu_info_json(s.gpu)}};
}

}  // namespace loom
