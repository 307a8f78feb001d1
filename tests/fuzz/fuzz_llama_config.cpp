// libFuzzer harness: a Hugging Face config.json read by LlamaConfig::from_json, then the derived
// figures and the JSON written back (which must parse again to the same shape).
#include <cstdint>
#include <string>

#include "model/llama_config.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  loom::fuzz::expect_loom_errors_only([&] {
    const loom::LlamaConfig c = loom::LlamaConfig::from_json(text, "fuzz config.json");
    (void)c.num_params();
    (void)c.num_params_no_embedding();
    (void)c.flops_per_token(128);
    const loom::LlamaConfig back = loom::LlamaConfig::from_json(c.to_json(), "round trip");
    if (back.hidden_size != c.hidden_size || back.vocab_size != c.vocab_size ||
        back.num_hidden_layers != c.num_hidden_layers)
      std::abort();
  });
  return 0;
}
