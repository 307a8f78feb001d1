// libFuzzer harness: GPT-2's encoder.json with vocab.bpe beside it. The input is encoder.json, a
// NUL byte, then vocab.bpe (the merges). Loaded by Tokenizer::load, then used.
#include <cstdint>
#include <filesystem>

#include "tests/fuzz/fuzz_util.hpp"
#include "tests/fuzz/tokenizer_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const auto [encoder, merges] = loom::fuzz::split_at(in, std::string_view("\0", 1));
  const std::string dir = loom::fuzz::scratch_dir() + "/gpt2";
  std::filesystem::create_directories(dir);
  const std::string path = loom::fuzz::write_file("gpt2/encoder.json", encoder);
  loom::fuzz::write_file("gpt2/vocab.bpe", merges);
  loom::fuzz::expect_loom_errors_only([&] { loom::fuzz::exercise(loom::Tokenizer::load(path)); });
  return 0;
}
