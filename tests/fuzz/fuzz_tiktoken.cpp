// libFuzzer harness: a tiktoken rank file (base64 token, space, rank per line; Llama 3's
// tokenizer.model, cl100k_base.tiktoken, ...) loaded by Tokenizer::load, then used.
#include <cstdint>

#include "tests/fuzz/fuzz_util.hpp"
#include "tests/fuzz/tokenizer_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path =
      loom::fuzz::write_file("ranks.tiktoken", {reinterpret_cast<const char*>(data), size});
  // As given (a known vocabulary is recognised by content; an unknown one is an error without a
  // pattern), and with a pattern, so that unknown rank files are parsed to the end too.
  loom::fuzz::expect_loom_errors_only([&] { loom::fuzz::exercise(loom::Tokenizer::load(path)); });
  loom::fuzz::expect_loom_errors_only(
      [&] { loom::fuzz::exercise(loom::Tokenizer::load(path, loom::Tokenizer::kGpt2Pattern)); });
  return 0;
}
