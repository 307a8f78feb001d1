#pragma once
// The subcommands of the `loom` command line. Each takes the arguments after its name.
#include <string>
#include <vector>

namespace loom {

using Args = std::vector<std::string>;

int bench_command(const Args& args);
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
