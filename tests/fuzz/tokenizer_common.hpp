#pragma once
// What the tokenizer harnesses do with a tokenizer that loads: encode and decode a fixed text
// with specials allowed and not (errors are loom::Error only, like loading).
#include <string>

#include "data/tokenizer.hpp"

namespace loom::fuzz {

inline void exercise(const loom::Tokenizer& t) {
  static const std::string text =
      "Version 3, <|endoftext|> hello  world!\n\tcaf\xc3\xa9 123456 \xe2\x82\xac\xff ok's  ";
  for (bool allow : {false, true}) {
    const auto ids = t.encode(text, allow);
    (void)t.decode(ids);
  }
  (void)t.vocab_size();
  (void)t.eot_id();
  if (t.vocab_size() > 0) (void)t.token_bytes(int32_t(t.vocab_size() - 1));
}

}  // namespace loom::fuzz
