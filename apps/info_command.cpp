// `loom info [--json] [--peak-seconds S]`: where loom runs. Version and commit, the CPU and the
// flags that matter, the tier of loom's kernels and of oneDNN (LOOM_CPU_ISA), how bf16 GEMMs run,
// the MPI library, the threads, and the f32/bf16 GEMM peaks measured now (the denominators of
// MFU). `loom bench step` prints the same header (apps/system_info.hpp).
#include <cstdio>
#include <string>

#include "apps/commands.hpp"
#include "apps/peak_seconds.hpp"
#include "apps/system_info.hpp"
#include "core/error.hpp"
#include "kernels/cpu/cpu_isa.hpp"

namespace loom {

namespace {

const char* kInfoUsage =
    "usage: loom info [--json] [--peak-seconds S] | loom info --tiers\n"
    "  prints the version, CPU, kernel and oneDNN tiers, bf16 GEMM path, MPI library, threads\n"
    "  and the measured f32/bf16 GEMM peaks (S seconds each, default 0.5; 0 skips them);\n"
    "  --tiers: only the LOOM_CPU_ISA tiers this CPU can run, one per line (for scripts)\n";

}  // namespace

int info_command(const Args& args) {
  bool json = false;
  double peak_seconds = 0.5;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kInfoUsage, stdout);
      return 0;
    } else if (a == "--tiers") {
      for (cpu::Isa t : cpu::cpu_isa().available) std::printf("%s\n", cpu::isa_name(t));
      return 0;
    } else if (a == "--json") {
      json = true;
    } else if (parse_peak_seconds(args, i, peak_seconds, kInfoUsage)) {
      // read into peak_seconds
    } else {
      fail("unexpected argument '", a, "'\n", kInfoUsage);
    }
  }
  const SystemInfo s = collect_system_info(peak_seconds);
  if (json)
    std::printf("%s\n", system_info_json(s).dump().c_str());
  else
    std::fputs(format_system_info(s).c_str(), stdout);
  return 0;
}

}  // namespace loom
