#pragma once
// `--peak-seconds S` (or `--peak-seconds=S`): the seconds `loom info`, `loom train` and `loom bench
// step` spend measuring the device's GEMM peak (0: not measured). Shared by the three commands.
#include <charconv>
#include <string>

#include "apps/commands.hpp"
#include "core/error.hpp"

namespace loom {

// True where args[i] is the flag: `seconds` is then its value and i its last argument; a value
// that is not a non-negative number is an error naming it, then `usage`.
inline bool parse_peak_seconds(const Args& args, size_t& i, double& seconds, const char* usage) {
  const std::string& a = args[i];
  if (a != "--peak-seconds" && a.rfind("--peak-seconds=", 0) != 0) return false;
  std::string v;
  if (a == "--peak-seconds") {
    LOOM_CHECK(i + 1 < args.size(), "--peak-seconds needs a number\n", usage);
    v = args[++i];
  } else {
    v = a.substr(15);
  }
  auto r = std::from_chars(v.data(), v.data() + v.size(), seconds);
  LOOM_CHECK(!v.empty() && r.ec == std::errc() && r.ptr == v.data() + v.size() && seconds >= 0,
             "--peak-seconds: expected a non-negative number, found '", v, "'\n", usage);
  return true;
}

}  // namespace loom
