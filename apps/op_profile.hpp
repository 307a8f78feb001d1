#pragma once
// `loom bench step --profile[=HARDWARE]`: every op of the timed steps timed on the rank
// (ops::ProfileOps) beside the price the planner's time model puts on the same work
// (plan::kernel_seconds on a hardware file, default cpu-local), summed by op. What the ops do not
// account for in the step (the framework, MPI's progress, waits) is the rest of the step time.
// Each op's achieved rates (its counted FLOPs and bytes over its time) stand beside the hardware
// file's ceilings (the peak and the memory bandwidth).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ops/ops.hpp"
#include "plan/hardware.hpp"

namespace loom {

class OpProfile {
 public:
  // `slow`: the time model's oversubscription factor (ranks sharing the node's rank slots);
  // `device`: the run's (whose allocator's requests are counted).
  OpProfile(plan::Hardware hw, double slow, Device device)
      : hw_(std::move(hw)), slow_(slow), device_(device) {}
  ops::ProfileOps::Sink sink();
  // Brackets the profiled steps: the process's page faults and the device allocator's requests
  // that reserved new memory in between (each a fresh page to fault in).
  void start();
  void stop();
  // The table, per step over `steps` timed steps, against `step_s` (the median step) and
  // `wait_s` (time in waits per step).
  std::string report(int steps, double step_s, double wait_s) const;

 private:
  struct Row {
    int64_t calls = 0;
    double seconds = 0, model = 0, flops = 0, bytes = 0;
  };
  plan::Hardware hw_;
  double slow_ = 1;
  Device device_ = Device::cpu;
  std::map<std::string, Row> rows_;
  long faults_ = 0;
  size_t os_allocs_ = 0, os_bytes_ = 0;
};

}  // namespace loom
