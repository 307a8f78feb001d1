// TEMPORARY until h5/hw lands.
#include "apps/commands.hpp"
#include "core/error.hpp"

namespace loom {
int plan_calibrate_command(const Args&) {
  fail("loom plan calibrate: not built yet");
}
}  // namespace loom
