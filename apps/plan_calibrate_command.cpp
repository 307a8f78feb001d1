// `loom plan calibrate [--output FILE] [--quick]`: measures this machine into a hardware file for
// `loom plan` (plan/calibrate.hpp). Under mpirun every rank measures at once and the collectives
// are measured too; rank 0 writes the file.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "distributed/mpi_process_group.hpp"
#include "model/model_config.hpp"
#include "plan/calibrate.hpp"
#include "train/config.hpp"
#include "train/rank_plan.hpp"

namespace loom {

namespace {
constexpr const char* kUsage =
    "usage: loom plan calibrate [--output FILE] [--quick] [--config FILE [--section.key=value "
    "...]]\n"
    "  measures GEMMs, attention, memory-bound ops, AdamW and (under mpirun) collectives with\n"
    "  OMP_NUM_THREADS threads per rank; writes FILE (default configs/hardware/cpu-local.toml)\n"
    "  --quick  fewer shapes and shorter timings (~10 s instead of ~60 s)\n"
    "  --config also the GEMM shapes of this job's step (and its tp/cp/pp splits), in its dtype\n";
}

int plan_calibrate_command(const Args& args) {
  std::string output = "configs/hardware/cpu-local.toml", config;
  std::vector<std::string> overrides;
  plan::CalibrateOptions opt;
  for (size_t i = args.empty() || args[0] != "calibrate" ? 0 : 1; i < args.size(); ++i) {
    if (args[i] == "--quick") {
      opt.quick = true;
    } else if (args[i] == "--output" && i + 1 < args.size()) {
      output = args[++i];
    } else if (args[i] == "--config" && i + 1 < args.size()) {
      config = args[++i];
    } else if (!config.empty() && args[i].rfind("--", 0) == 0 &&
               args[i].find('.') != std::string::npos) {
      overrides.push_back(args[i]);
    } else if (args[i] == "--help" || args[i] == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "loom plan calibrate: unexpected argument '%s'\n%s", args[i].c_str(),
                   kUsage);
      return 2;
    }
  }
  if (!config.empty()) {
    JobConfig job = load_job_config(config, overrides);
    job.parallelism = JobConfig::Parallelism{};  // one rank's whole step: the splits are added
    const ModelConfig model = ModelConfig::from_file(resolve_model_config(
        job.model.config, std::filesystem::path(config).parent_path().string()));
    const PlanJob j{job, model, 1};
    opt.gemm_shapes = plan::step_gemm_shapes(j);
    opt.gemm_shapes_dtype = dtype_from_name(job.training.mixed_precision_param);
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
