#include "apps/op_profile.hpp"

#include <algorithm>
#include <cstdio>
#include <utility>

#include <sys/resource.h>

#include "core/allocator.hpp"
#include "core/error.hpp"

namespace loom {

ops::ProfileOps::Sink OpProfile::sink() {
  return [this](const char* op, const std::vector<ops::KernelWork>& works, double s) {
    Row& r = rows_[op];
    r.calls += 1;
    r.seconds += s;
    for (const ops::KernelWork& w : works) {
      r.model += plan::kernel_seconds(w, hw_) * slow_;
      r.flops += w.flops;
      r.bytes += w.bytes;
    }
  };
}

namespace {

long page_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt + u.ru_majflt;
}

}  // namespace

void OpProfile::start() {
  const AllocatorStats st = Allocator::get(device_).stats();
  faults_ = page_faults();
  os_allocs_ = st.num_os_allocs;
  os_bytes_ = st.reserved;
}

void OpProfile::stop() {
  const AllocatorStats st = Allocator::get(device_).stats();
  faults_ = page_faults() - faults_;
  os_allocs_ = st.num_os_allocs - os_allocs_;
  os_bytes_ = st.reserved - os_bytes_;
}

std::string OpProfile::report(int steps, double step_s, double wait_s) const {
  const double n = std::max(steps, 1);
  std::vector<std::pair<std::string, Row>> rows(rows_.begin(), rows_.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  std::string out =
      str_cat("  ops per step (the rank's time on its device; the model: ", hw_.name,
              " priced as `loom plan` does, x", slow_,
              " for oversubscribed cores; TFLOP/s and GB/s: the op's counted work over its time, "
              "beside the ceilings ",
              hw_.peak_bf16 * 1e-12, " TFLOP/s bf16, ", hw_.peak_f32 * 1e-12, " f32, ",
              hw_.memory_bandwidth * 1e-9, " GB/s)\n");
  char line[200];
  std::snprintf(line, sizeof line, "    %-28s %8s %10s %10s %8s %9s %9s\n", "op", "calls", "ms",
                "model ms", "model/ms", "TFLOP/s", "GB/s");
  out += line;
  const auto rates = [](const Row& r) {
    return std::pair(r.seconds > 0 ? r.flops / r.seconds * 1e-12 : 0.0,
                     r.seconds > 0 ? r.bytes / r.seconds * 1e-9 : 0.0);
  };
  Row all;
  for (const auto& [op, r] : rows) {
    const auto [tf, gb] = rates(r);
    std::snprintf(line, sizeof line, "    %-28s %8.0f %10.2f %10.2f %8.2f %9.3g %9.4g\n",
                  op.c_str(), double(r.calls) / n, r.seconds / n * 1e3, r.model / n * 1e3,
                  r.seconds > 0 ? r.model / r.seconds : 0.0, tf, gb);
    out += line;
    all.calls += r.calls, all.seconds += r.seconds, all.model += r.model;
    all.flops += r.flops, all.bytes += r.bytes;
  }
  const auto [tf, gb] = rates(all);
  std::snprintf(line, sizeof line, "    %-28s %8.0f %10.2f %10.2f %8.2f %9.3g %9.4g\n", "all ops",
                double(all.calls) / n, all.seconds / n * 1e3, all.model / n * 1e3,
                all.seconds > 0 ? all.model / all.seconds : 0.0, tf, gb);
  out += line;
  const double outside = step_s - all.seconds / n;
  std::snprintf(line, sizeof line,
                "    step %.2f ms = ops %.2f + outside ops %.2f (of which waits %.2f, the rest "
                "framework and MPI calls)\n",
                step_s * 1e3, all.seconds / n * 1e3, outside * 1e3, wait_s * 1e3);
  out += line;
  std::snprintf(line, sizeof line,
                "    page faults %.0f a step; the allocator reserved new memory %.1f times a step "
                "(reserved %+.2f MiB over the steps)\n",
                double(faults_) / n, double(os_allocs_) / n,
                double(int64_t(os_bytes_)) / 1048576.0);
  out += line;
  return out;
}

}  // namespace loom
