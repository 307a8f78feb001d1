// libFuzzer harness: the job configuration, TOML text plus `--section.key=value` overrides. The
// input is the TOML, then optionally a NUL byte and one override per line. A configuration that
// resolves is written back with to_toml, which must parse to the same configuration.
#include <cstdint>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.hpp"
#include "train/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const auto parts = loom::fuzz::split_at(in, std::string_view("\0", 1));
  const std::string toml(parts.first);
  const std::string_view rest = parts.second;
  std::vector<std::string> overrides;
  for (std::string_view r = rest; !r.empty();) {
    const auto [line, next] = loom::fuzz::split_at(r, "\n");
    overrides.emplace_back(line);
    r = next;
  }
  loom::fuzz::expect_loom_errors_only([&] {
    const loom::JobConfig c = loom::parse_job_config(toml, "fuzz.toml", overrides);
    const loom::JobConfig back = loom::parse_job_config(loom::to_toml(c), "round trip");
    if (!(back == c)) {
      std::fprintf(stderr, "fuzz: to_toml does not round-trip:\n%s\n", loom::to_toml(c).c_str());
      std::abort();
    }
  });
  return 0;
}
