// libFuzzer harness: a Hugging Face tokenizer.json (byte-level BPE: model.vocab, model.merges,
// added_tokens, the Split pre-tokenizer's pattern) loaded by Tokenizer::load, then used.
#include <cstdint>

#include "tests/fuzz/fuzz_util.hpp"
#include "tests/fuzz/tokenizer_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path =
      loom::fuzz::write_file("tokenizer.json", {reinterpret_cast<const char*>(data), size});
  loom::fuzz::expect_loom_errors_only([&] { loom::fuzz::exercise(loom::Tokenizer::load(path)); });
  return 0;
}
