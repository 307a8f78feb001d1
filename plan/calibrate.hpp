#pragma once
// `loom plan calibrate`: measures this machine with loom's own cpu kernels (through ops:: on cpu
// tensors of random values) and, under mpirun, its collectives, into a hardware model
// (plan/hardware.hpp) for the planner.
#include <iosfwd>
#include <string>
#include <vector>

#include "distributed/process_group.hpp"
#include "plan/hardware.hpp"

namespace loom {
struct PlanJob;  // train/rank_plan.hpp
}  // namespace loom

namespace loom::plan {

struct CalibrateOptions {
  bool quick = false;  // a few shapes and short timings (tests): ~10 s instead of ~60
  std::string name = "cpu-local";
  // GEMM shapes (M, N, K) measured besides the grid, in this dtype: a model's own (`--config`),
  // whose odd widths run off the grid's powers of 4.
  std::vector<GemmPoint> gemm_shapes;
  DType gemm_shapes_dtype = DType::f32;
};

// The GEMM shapes of one rank's training step of `j` (planned on meta), with M halved and
// quartered (cp, pp micro-batches) and N and K halved (tp), each once.
std::vector<GemmPoint> step_gemm_shapes(const PlanJob& j);

struct Calibration {
  Hardware hw;
  // The measurements behind the figures, one line each, written as comments in the file.
  std::vector<std::string> notes;
  int ranks = 1;
  double seconds = 0;  // the calibration's own wall time
  std::string cpu;     // the processor's model name
};

// Every rank of `world` (null: this process alone) measures at once, as training runs them side
// by side; the collectives are measured when it has more than one rank. Progress lines go to
// `log` (null: none).
Calibration calibrate(const CalibrateOptions& opt, dist::ProcessGroup* world, std::ostream* log);

// The hardware file of a calibration: loadable by parse_hardware, its notes as comments.
std::string hardware_toml(const Calibration& c);

}  // namespace loom::plan
