// `loom plan calibrate [--output FILE] [--quick]`: measures this machine into a hardware file for
// `loom plan` (plan/calibrate.hpp). Under mpirun every rank measures at once and the collectives
// are measured too; rank 0 writes the file.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "distributed/mpi_process_group.hpp"
#include "plan/calibrate.hpp"

namespace loom {

namespace {
constexpr const char* kUsage =
    "usage: loom plan calibrate [--output FILE] [--quick]\n"
    "  measures GEMMs, attention, memory-bound ops, AdamW and (under mpirun) collectives with\n"
    "  OMP_NUM_THREADS threads per rank; writes FILE (default configs/hardware/cpu-local.toml)\n"
    "  --quick  fewer shapes and shorter timings (~10 s instead of ~60 s)\n";
}

int plan_calibrate_command(const Args& args) {
  std::string output = "configs/hardware/cpu-local.toml";
  plan::CalibrateOptions opt;
  for (size_t i = args.empty() || args[0] != "calibrate" ? 0 : 1; i < args.size(); ++i) {
    if (args[i] == "--quick") {
      opt.quick = true;
    } else if (args[i] == "--output" && i + 1 < args.size()) {
      output = args[++i];
    } else if (args[i] == "--help" || args[i] == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "loom plan calibrate: unexpected argument '%s'\n%s", args[i].c_str(),
                   kUsage);
      return 2;
    }
  }
  // MPI outlives the group (destroyed first, in reverse order of declaration).
  std::optional<dist::MpiRuntime> mpi;
  std::unique_ptr<dist::ProcessGroup> world;
  if (dist::launched_under_mpi()) {
    mpi.emplace();
    world = dist::make_mpi_world_group();
  }
  const plan::Calibration c = plan::calibrate(opt, world.get(), &std::cout);
  if (world && world->rank() != 0) return 0;
  {
    std::ofstream out(output);
    LOOM_CHECK(out.good(), "cannot write '", output, "'");
    out << plan::hardware_toml(c);
    LOOM_CHECK(out.good(), "writing '", output, "' failed");
  }
  std::printf("wrote %s (%.1f s)\n", output.c_str(), c.seconds);
  return 0;
}

}  // namespace loom
