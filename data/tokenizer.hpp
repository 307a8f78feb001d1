#pragma once
// Byte-level BPE (GPT-2 / tiktoken / Llama 3 family). Text is split by a pre-tokenizer regex
// (PCRE2, so the GPT-2 and Llama 3 patterns run unchanged), each piece's UTF-8 bytes are merged by
// rank, and special tokens (e.g. <|begin_of_text|>) map to their own ids.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom {

class Tokenizer {
 public:
  // The split patterns of the known vocabularies (PCRE2 syntax, $ = end of text).
  static const char* kGpt2Pattern;    // r50k / GPT-2
  static const char* kCl100kPattern;  // cl100k as tiktoken runs it now (\s+$ at the end of text)
  static const char* kO200kPattern;
  static const char* kLlama3Pattern;  // Meta's Llama 3 (tokenizer.model / tokenizer.json)
  // "gpt2" (also "r50k", "p50k"), "cl100k", "o200k" or "llama3" -> that pattern; anything else is
  // taken as a regex and returned as it is.
  static std::string pattern_named(const std::string& name);

  // Loads by file content: a Hugging Face tokenizer.json (byte-level BPE model; added_tokens are
  // the specials; pattern from its Split pre-tokenizer), a GPT-2 encoder.json with vocab.bpe (or
  // merges.txt) beside it (kGpt2Pattern; encoder entries that no merge makes, <|endoftext|>, are
  // the specials), or a tiktoken rank file (base64 token + rank per line). A rank file has no
  // pattern or specials of its own: the known ones (r50k_base, p50k_base, cl100k_base, o200k_base,
  // Meta's Llama 3 tokenizer.model) are recognised by content and get their pattern and specials
  // (end-of-text included); any other needs `pattern` (an error otherwise). A non-empty `pattern`
  // replaces the file's; `specials` are added to the file's. Errors name the file and the line or
  // entry that is malformed.
  static Tokenizer load(const std::string& path, const std::string& pattern = "",
                        const std::unordered_map<std::string, int32_t>& specials = {});

  // Trains a vocabulary of `vocab_size` ids (256 byte tokens + merges + specials) on `text`
  // split by `pattern` (specials in `text` are cut out, never learned from). Each merge is the
  // most frequent adjacent pair, ties to the smallest (left, right) ids, so the result is
  // deterministic. Specials take the ids after the merges; with too small a corpus the merges
  // stop early and vocab_size() is smaller than asked.
  static Tokenizer train(std::string_view text, int64_t vocab_size,
                         const std::vector<std::string>& specials = {"<|endoftext|>"},
                         const std::string& pattern = kCl100kPattern);

  // Saves as a Hugging Face tokenizer.json (byte-level BPE), which load() reads back.
  void save(const std::string& path) const;

  // Special tokens in the text are encoded as their ids only if allow_special is true; otherwise
  // they are ordinary text. Any bytes are accepted (invalid UTF-8 is encoded byte for byte), and
  // concurrent calls from several threads are safe.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = false) const;
  std::string decode(const std::vector<int32_t>& ids) const;  // the exact bytes (may be
                                                              // incomplete UTF-8)
  std::string token_bytes(int32_t id) const;

  int64_t vocab_size() const;                         // 1 + the largest id
  int32_t special_id(const std::string& name) const;  // -1 if absent
  // The id that separates documents: <|endoftext|> or <|end_of_text|>, -1 if neither exists.
  int32_t eot_id() const;

  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  struct Impl;  // opaque; defined in data/tokenizer_impl.hpp for the tokenizer's own files

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
