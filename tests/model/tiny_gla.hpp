#pragma once
// The tiny GLA the model tests share: 64 wide, 4 heads over 2 kv heads (head dims 8 and 16), an
// MLP of 96, 2 layers unless asked; the vocabulary, the short convolution and tied embeddings as
// each test needs.
#include <cstdint>

#include "model/gla_config.hpp"

namespace loom::test {

inline GlaConfig tiny_gla_config(int64_t vocab, bool conv = false, bool tied = false,
                                 int64_t layers = 2) {
  GlaConfig c;
  c.hidden_size = 64;
  c.num_hidden_layers = layers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 96;
  c.vocab_size = vocab;
  c.use_short_conv = conv;
  c.tie_word_embeddings = tied;
  return c;
}

}  // namespace loom::test
