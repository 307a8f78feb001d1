#pragma once
// The subcommands of the `loom` command line. Each takes the arguments after its name.
#include <string>
#include <vector>

namespace loom {

using Args = std::vector<std::string>;

// The exit code of a `loom train` that a signal stopped (after saving): not 0, so that Slurm's
// afterok dependencies and requeue loops tell it from a finished run, and not 1 (an error) or 2
// (a usage error), which main() returns.
constexpr int kExitInterrupted = 3;

int bench_command(const Args& args);
// `loom bench attention`: the device's attention kernels alone (apps/bench_attention_command.cpp).
int bench_attention_command(const Args& args);
int train_command(const Args& args);
int tokenize_command(const Args& args);
int generate_command(const Args& args);
int plot_command(const Args& args);
int info_command(const Args& args);
int convert_command(const Args& args);
int plan_command(const Args& args);
// `loom plan calibrate`: measures this machine and writes a hardware model (configs/hardware/).
int plan_calibrate_command(const Args& args);

}  // namespace loom
