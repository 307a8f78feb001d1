#pragma once
// Internals of the byte-level BPE tokenizer, shared by tokenizer.cpp (encode/decode),
// tokenizer_formats.cpp (load/save) and tokenizer_train.cpp (training). Not part of the API.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/tokenizer.hpp"

namespace loom::tok {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  return x;
}

// Pieces are a few bytes long: fixed-size (possibly overlapping) loads, no byte loop, no memcpy
// of a variable length, one mix per 8 bytes.
inline uint64_t hash_bytes(const char* p, size_t n) {
  auto load32 = [](const char* q) {
    uint32_t w;
    std::memcpy(&w, q, 4);
    return uint64_t(w);
  };
  auto load64 = [](const char* q) {
    uint64_t w;
    std::memcpy(&w, q, 8);
    return w;
  };
  uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
  if (n <= 8) {
    uint64_t w = 0;
    if (n >= 4) {
      w = load32(p) | (load32(p + n - 4) << 32);
    } else if (n > 0) {
      w = (uint64_t(uint8_t(p[0])) << 16) | (uint64_t(uint8_t(p[n >> 1])) << 8) | uint8_t(p[n - 1]);
    }
    return mix64((h ^ w) * 0xc4ceb9fe1a85ec53ull);
  }
  const char* last = p + n - 8;
  for (; p < last; p += 8) {
    h = (h ^ load64(p)) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
  }
  return mix64((h ^ load64(last)) * 0xc4ceb9fe1a85ec53ull);
}

inline uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

// A merge: rank in the high 32 bits, the merged id in the low 32 bits, so that comparing two
// merges as integers compares their ranks (equal ranks only ever belong to one merged token).
constexpr uint64_t kNoMerge = ~0ull;
inline uint64_t merge_value(uint32_t rank, int32_t merged) {
  return (uint64_t(rank) << 32) | uint32_t(merged);
}
inline int32_t merged_id(uint64_t merge) {
  return int32_t(uint32_t(merge));
}
inline uint32_t merge_rank(uint64_t merge) {
  return uint32_t(merge >> 32);
}

// Open-addressing hash map (left, right) -> merge, the hot lookup of BPE.
class PairTable {
 public:
  void reserve(size_t n);
  // Keeps the first merge given for a pair.
  bool insert(int32_t left, int32_t right, uint64_t merge);
  uint64_t find(int32_t left, int32_t right) const {
    if (slots_.empty()) return kNoMerge;
    const uint64_t key = pair_key(left, right);
    for (size_t i = mix64(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == kEmpty) return kNoMerge;
    }
  }
  size_t size() const { return size_; }
  // All pairs as (key, merge), in no particular order.
  std::vector<std::pair<uint64_t, uint64_t>> items() const;

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  struct Slot {
    uint64_t key = kEmpty;
    uint64_t value = kNoMerge;
  };
  void grow();
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// Token bytes -> id over the ordinary (non-special) tokens.
class BytesIndex {
 public:
  void build(const std::vector<std::string>& tokens, const std::vector<uint8_t>& kinds);
  int32_t find(const std::vector<std::string>& tokens, std::string_view s) const {
    return find(tokens, s, hash_bytes(s.data(), s.size()));
  }
  int32_t find(const std::vector<std::string>& tokens, std::string_view s, uint64_t h) const {
    if (slots_.empty()) return -1;
    const uint32_t tag = uint32_t(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& sl = slots_[i];
      if (sl.id < 0) return -1;
      if (sl.tag == tag && tokens[sl.id] == s) return sl.id;
    }
  }

 private:
  struct Slot {
    uint32_t tag = 0;
    int32_t id = -1;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct PcreCodeFree {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};

// A compiled, JIT-compiled PCRE2 pattern (shared read-only between threads).
class Regex {
 public:
  Regex() = default;
  // `what` names the pattern in errors (e.g. "split pattern of FILE").
  Regex(std::string_view pattern, uint32_t options, const std::string& what);
  pcre2_code* code() const { return code_.get(); }
  bool jit() const { return jit_; }
  explicit operator bool() const { return code_ != nullptr; }

 private:
  std::unique_ptr<pcre2_code, PcreCodeFree> code_;
  bool jit_ = false;
};

// Per-call match state of one Regex: match data and, only when a match needs more than the
// default 32 KiB, a larger JIT stack.
class Matcher {
 public:
  explicit Matcher(const Regex& re);
  ~Matcher();
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;
  // The next match in s[0, len) that starts at or after `start`: [*b, *e). False if none.
  bool find(const char* s, size_t len, size_t start, size_t* b, size_t* e);

 private:
  const Regex& re_;
  pcre2_match_data* md_ = nullptr;
  pcre2_match_context* mctx_ = nullptr;
  pcre2_jit_stack* stack_ = nullptr;
  size_t stack_size_ = 0;
};

// Calls on_piece(begin, end) for each piece of s[0, len) as split by `re`; text the pattern does
// not cover (bytes of invalid UTF-8, for the known patterns) becomes a piece too, so no byte is
// ever dropped.
template <class F>
void split_pieces(Matcher& m, const char* s, size_t len, F&& on_piece) {
  size_t pos = 0, search = 0, b = 0, e = 0;
  while (search < len && m.find(s, len, search, &b, &e)) {
    if (e == b) {  // an empty match consumes nothing: step over one byte and go on
      search = b + 1;
      continue;
    }
    if (b > pos) on_piece(pos, b);
    on_piece(b, e);
    pos = search = e;
  }
  if (pos < len) on_piece(pos, len);
}

// BPE of one piece, in place on ids[0, n); returns the new length. Repeatedly merges the pair of
// lowest rank, the leftmost of equals. bpe_scan rescans the ranks (fast for short pieces), bpe_heap
// keeps them in a heap (for long pieces); they give the same result.
int bpe_scan(const PairTable& pairs, int32_t* ids, int n, uint64_t* ranks);
int bpe_heap(const PairTable& pairs, int32_t* ids, int n);
constexpr int kHeapFrom = 96;  // piece length (bytes) from which bpe_heap is used

// GPT-2's byte <-> unicode table used by encoder.json, vocab.bpe and byte-level tokenizer.json.
const std::array<char32_t, 256>& byte_to_char();
int byte_of_char(char32_t c);  // -1 if c is not one of the 256 symbols
std::string to_byte_level(std::string_view bytes);
// False if `s` is not UTF-8 made of byte-level symbols; *bad is the offending code point.
bool from_byte_level(std::string_view s, std::string* out, char32_t* bad);

enum : uint8_t { kHole = 0, kNormal = 1, kSpecial = 2 };

class PieceCache;  // per-call cache of encoded pieces (tokenizer.cpp)

}  // namespace loom::tok

namespace loom {

struct Tokenizer::Impl {
  std::vector<std::string> tokens;  // by id: the bytes of a token, the text of a special
  std::vector<uint8_t> kinds;       // tok::kHole / kNormal / kSpecial, by id
  tok::PairTable pairs;
  bool ignore_merges = false;  // a piece that is a token is that token (tiktoken, Llama 3)
  std::string pattern;
  std::vector<std::pair<std::string, int32_t>> specials;  // sorted by text

  // Built by finish():
  std::array<int32_t, 256> byte_ids{};
  tok::BytesIndex index;
  tok::Regex split;
  tok::Regex special_re;  // alternation of all specials, longest first
  int32_t eot = -1;

  // Sets token `id`, growing the tables; fails if the id is taken (`what` names the source).
  void set_token(int32_t id, std::string bytes, uint8_t kind, const std::string& what);
  // Checks the vocabulary (all 256 bytes present) and builds the index and regexes.
  void finish(const std::string& what);
  void encode_ordinary(std::string_view text, tok::Matcher& m, tok::PieceCache& cache,
                       std::vector<int32_t>& out) const;
};

}  // namespace loom
