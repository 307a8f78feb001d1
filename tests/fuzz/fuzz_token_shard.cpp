// libFuzzer harness: a token shard (64-byte LOOMTOKS header, then the ids) opened by Shard and
// by TokenStream as a one-shard dataset, and read whole.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "data/token_shard.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = loom::fuzz::scratch_dir() + "/data";
  std::filesystem::create_directories(dir);
  const std::string path =
      loom::fuzz::write_file("data/train-00000.bin", {reinterpret_cast<const char*>(data), size});
  loom::fuzz::expect_loom_errors_only([&] {
    loom::Shard s(path);
    std::vector<int32_t> out(size_t(s.size()) + 1);
    s.read(0, s.size(), out.data());
    if (s.size() > 0) (void)s[s.size() - 1];
  });
  loom::fuzz::expect_loom_errors_only([&] {
    loom::TokenStream ts(dir, "train");
    std::vector<int32_t> out(size_t(ts.size()) * 2 + 1);
    ts.read(ts.size() / 2, ts.size() + 1, out.data());
  });
  return 0;
}
