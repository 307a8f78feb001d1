// Byte-level BPE: the split patterns, the hash tables, PCRE2 matching, BPE merging, encode/decode.
#include "data/tokenizer.hpp"

#include <algorithm>
#include <cctype>
#include <queue>

#include "core/error.hpp"
#include "data/tokenizer_impl.hpp"

namespace loom {

// The patterns as the reference tokenizers (tiktoken and its ports) run them. Contractions are
// spelt with ASCII classes rather than (?i:...): under PCRE2's Unicode case folding 's would also
// match U+017F (long s), which the references do not. $ is the end of the text (the patterns are
// compiled with PCRE2_DOLLAR_ENDONLY, as in JavaScript and Rust).
const char* Tokenizer::kGpt2Pattern =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re";
const char* Tokenizer::kCl100kPattern =
    R"re('(?:[sS]|[dD]|[mM]|[tT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)re"
    R"re( ?[^\s\p{L}\p{N}]+[\r\n]*|\s+$|\s*[\r\n]|\s+(?!\S)|\s)re";
const char* Tokenizer::kO200kPattern =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+)re"
    R"re((?:'(?:[sS]|[dD]|[mM]|[tT]|[lL][lL]|[vV][eE]|[rR][eE]))?|)re"
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*)re"
    R"re((?:'(?:[sS]|[dD]|[mM]|[tT]|[lL][lL]|[vV][eE]|[rR][eE]))?|)re"
    R"re(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
const char* Tokenizer::kLlama3Pattern =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)re"
    R"re( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

namespace tok {

// ------------------------------------------------------------------------------- hash tables

void PairTable::reserve(size_t n) {
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  size_ = 0;
  for (const Slot& s : old) {
    if (s.key != kEmpty) insert(int32_t(s.key >> 32), int32_t(uint32_t(s.key)), s.value);
  }
}

void PairTable::grow() {
  reserve(std::max<size_t>(size_ + 1, slots_.size()));
}

bool PairTable::insert(int32_t left, int32_t right, uint64_t merge) {
  if (2 * (size_ + 1) > slots_.size()) grow();
  const uint64_t key = pair_key(left, right);
  for (size_t i = mix64(key) & mask_;; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key == key) return false;
    if (s.key == kEmpty) {
      s.key = key;
      s.value = merge;
      ++size_;
      return true;
    }
  }
}

std::vector<std::pair<uint64_t, uint64_t>> PairTable::items() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  out.reserve(size_);
  for (const Slot& s : slots_) {
    if (s.key != kEmpty) out.emplace_back(s.key, s.value);
  }
  return out;
}

void BytesIndex::build(const std::vector<std::string>& tokens, const std::vector<uint8_t>& kinds) {
  size_t n = 0;
  for (uint8_t k : kinds) n += k == kNormal;
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (kinds[id] != kNormal) continue;
    const uint64_t h = hash_bytes(tokens[id].data(), tokens[id].size());
    size_t i = h & mask_;
    while (slots_[i].id >= 0) i = (i + 1) & mask_;
    slots_[i] = Slot{uint32_t(h >> 32), int32_t(id)};
  }
}

// ------------------------------------------------------------------------------- PCRE2

namespace {

std::string pcre_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

Regex::Regex(std::string_view pattern, uint32_t options, const std::string& what) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* c = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                options, &err, &off, nullptr);
  if (!c) {
    fail(what, ": PCRE2 cannot compile the pattern at offset ", off, " (", pcre_message(err),
         "); expected a PCRE2/Perl-compatible regular expression: ", pattern);
  }
  code_.reset(c);
  // Without JIT (a PCRE2 built without it) matching still works through the interpreter.
  jit_ = pcre2_jit_compile(c, PCRE2_JIT_COMPLETE) == 0;
}

Matcher::Matcher(const Regex& re) : re_(re) {
  md_ = pcre2_match_data_create_from_pattern(re.code(), nullptr);
  LOOM_CHECK(md_ != nullptr, "tokenizer: out of memory creating PCRE2 match data");
}

Matcher::~Matcher() {
  if (stack_) pcre2_jit_stack_free(stack_);
  if (mctx_) pcre2_match_context_free(mctx_);
  pcre2_match_data_free(md_);
}

bool Matcher::find(const char* s, size_t len, size_t start, size_t* b, size_t* e) {
  const auto subject = reinterpret_cast<PCRE2_SPTR>(s);
  for (;;) {
    const int rc = re_.jit() ? pcre2_jit_match(re_.code(), subject, len, start, 0, md_, mctx_)
                             : pcre2_match(re_.code(), subject, len, start, 0, md_, mctx_);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && stack_size_ < (size_t(256) << 20)) {
      // Rare (very long runs under a pattern with nested groups): retry with a bigger stack.
      stack_size_ = stack_size_ ? 4 * stack_size_ : (size_t(1) << 20);
      if (stack_) pcre2_jit_stack_free(stack_);
      stack_ = pcre2_jit_stack_create(32 * 1024, stack_size_, nullptr);
      if (!mctx_) mctx_ = pcre2_match_context_create(nullptr);
      LOOM_CHECK(stack_ && mctx_, "tokenizer: out of memory for a PCRE2 JIT stack");
      pcre2_jit_stack_assign(mctx_, nullptr, stack_);
      continue;
    }
    if (rc < 0) {
      fail("tokenizer: PCRE2 match failed at byte ", start, " (", pcre_message(rc), ")");
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md_);
    *b = ov[0];
    *e = ov[1];
    return true;
  }
}

// ------------------------------------------------------------------------------- BPE

int bpe_scan(const PairTable& pairs, int32_t* ids, int n, uint64_t* ranks) {
  for (int i = 0; i + 1 < n; ++i) ranks[i] = pairs.find(ids[i], ids[i + 1]);
  while (n > 1) {
    uint64_t best = kNoMerge;
    int bi = -1;
    for (int i = 0; i + 1 < n; ++i) {
      if (ranks[i] < best) {
        best = ranks[i];
        bi = i;
      }
    }
    if (bi < 0) break;
    ids[bi] = merged_id(best);
    const int tail = n - bi - 2;  // pairs and ids after the merged pair
    std::memmove(ids + bi + 1, ids + bi + 2, size_t(tail) * sizeof(int32_t));
    std::memmove(ranks + bi, ranks + bi + 1, size_t(tail) * sizeof(uint64_t));
    --n;
    if (bi + 1 < n) ranks[bi] = pairs.find(ids[bi], ids[bi + 1]);
    if (bi > 0) ranks[bi - 1] = pairs.find(ids[bi - 1], ids[bi]);
  }
  return n;
}

int bpe_heap(const PairTable& pairs, int32_t* ids, int n) {
  // A doubly linked list over the positions; a node keeps the position of its first byte, so
  // ordering heap entries by (rank, position) merges the leftmost of equal ranks first.
  std::vector<int> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  using Entry = std::pair<uint64_t, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int i = 0; i + 1 < n; ++i) {
    const uint64_t r = pairs.find(ids[i], ids[i + 1]);
    if (r != kNoMerge) heap.emplace(r, i);
  }
  while (!heap.empty()) {
    const auto [r, i] = heap.top();
    heap.pop();
    // Entries go stale when a neighbour merges; the pair now at i must still be this merge.
    if (!alive[i] || next[i] < 0 || pairs.find(ids[i], ids[next[i]]) != r) continue;
    const int j = next[i];
    ids[i] = merged_id(r);
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    if (prev[i] >= 0) {
      const uint64_t q = pairs.find(ids[prev[i]], ids[i]);
      if (q != kNoMerge) heap.emplace(q, prev[i]);
    }
    if (next[i] >= 0) {
      const uint64_t q = pairs.find(ids[i], ids[next[i]]);
      if (q != kNoMerge) heap.emplace(q, i);
    }
  }
  int m = 0;
  for (int i = 0; i >= 0; i = next[i]) ids[m++] = ids[i];
  return m;
}

// ------------------------------------------------------------------------------- byte level

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    // Printable Latin-1 bytes stand for themselves; the others get U+0100 onwards, in byte order.
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      t[b] = printable ? char32_t(b) : char32_t(256 + n++);
    }
    return t;
  }();
  return table;
}

int byte_of_char(char32_t c) {
  static const std::array<int16_t, 324> table = [] {
    std::array<int16_t, 324> t{};
    t.fill(-1);
    const auto& fwd = byte_to_char();
    for (int b = 0; b < 256; ++b) t[fwd[b]] = int16_t(b);
    return t;
  }();
  return c < table.size() ? table[c] : -1;
}

std::string to_byte_level(std::string_view bytes) {
  const auto& fwd = byte_to_char();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) {
    const char32_t c = fwd[b];
    if (c < 0x80) {
      out += char(c);
    } else {  // all symbols are below U+0800: two UTF-8 bytes
      out += char(0xC0 | (c >> 6));
      out += char(0x80 | (c & 0x3F));
    }
  }
  return out;
}

bool from_byte_level(std::string_view s, std::string* out, char32_t* bad) {
  out->clear();
  for (size_t i = 0; i < s.size();) {
    const unsigned char c0 = s[i];
    char32_t c;
    size_t len;
    if (c0 < 0x80) {
      c = c0;
      len = 1;
    } else if ((c0 & 0xE0) == 0xC0 && i + 1 < s.size()) {
      c = char32_t(((c0 & 0x1F) << 6) | (s[i + 1] & 0x3F));
      len = 2;
    } else {  // longer sequences are never byte-level symbols; report the code point
      c = c0;
      len = (c0 & 0xF0) == 0xE0 ? 3 : (c0 & 0xF8) == 0xF0 ? 4 : 1;
      if (i + len <= s.size() && len > 1) {
        c = c0 & (len == 3 ? 0x0F : 0x07);
        for (size_t k = 1; k < len; ++k) c = (c << 6) | (s[i + k] & 0x3F);
      }
      *bad = c;
      return false;
    }
    const int b = byte_of_char(c);
    if (b < 0) {
      *bad = c;
      return false;
    }
    *out += char(b);
    i += len;
  }
  return true;
}

// ------------------------------------------------------------------------------- piece cache

// Encoded pieces of one encode() call, keyed by their bytes: most words of a text repeat, and a
// hit costs one hash of a few bytes and one probe of a slot that holds the whole hash, the key's
// place and the ids' place. Keys and ids live in two flat arenas.
class PieceCache {
 public:
  const int32_t* find(std::string_view s, uint64_t h, int* n) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& sl = slots_[i];
      if (sl.key_len == 0) return nullptr;
      if (sl.hash == h && sl.key_len == s.size() && same(keys_.data() + sl.key_off, s)) {
        *n = sl.ids_len;
        return ids_.data() + sl.ids_off;
      }
    }
  }
  void insert(std::string_view s, uint64_t h, const int32_t* ids, int n) {
    if (s.size() > kMaxPiece || keys_.size() + s.size() > kMaxKeyBytes) return;
    if (2 * (size_ + 1) > slots_.size()) rehash();
    size_t i = h & mask_;
    while (slots_[i].key_len != 0) i = (i + 1) & mask_;
    slots_[i] =
        Slot{h, uint32_t(keys_.size()), uint32_t(ids_.size()), uint16_t(s.size()), uint16_t(n)};
    ++size_;
    keys_.append(s);
    ids_.insert(ids_.end(), ids, ids + n);
  }

 private:
  static constexpr size_t kMaxKeyBytes = size_t(1) << 28;
  static constexpr size_t kMaxPiece = 256;  // longer pieces hardly repeat; ids_len fits 16 bits
  struct Slot {
    uint64_t hash;
    uint32_t key_off, ids_off;
    uint16_t key_len, ids_len;  // key_len 0: empty (pieces are never empty)
  };
  // Pieces are short: compare 8 bytes at a time rather than calling memcmp.
  static bool same(const char* a, std::string_view b) {
    size_t n = b.size(), i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t x, y;
      std::memcpy(&x, a + i, 8);
      std::memcpy(&y, b.data() + i, 8);
      if (x != y) return false;
    }
    for (; i < n; ++i) {
      if (a[i] != b[i]) return false;
    }
    return true;
  }
  void rehash() {
    const size_t cap = std::max<size_t>(256, slots_.size() * 2);
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{0, 0, 0, 0, 0});
    mask_ = cap - 1;
    for (const Slot& sl : old) {
      if (sl.key_len == 0) continue;
      size_t i = sl.hash & mask_;
      while (slots_[i].key_len != 0) i = (i + 1) & mask_;
      slots_[i] = sl;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
  std::string keys_;
  std::vector<int32_t> ids_;
};

}  // namespace tok

// ------------------------------------------------------------------------------- Impl

void Tokenizer::Impl::set_token(int32_t id, std::string bytes, uint8_t kind,
                                const std::string& what) {
  LOOM_CHECK(id >= 0, what, ": token id ", id, " is negative; expected ids >= 0");
  // The table has an entry per id up to the largest: a corrupt file's id near 2^31 would ask for
  // 64 GB (found by tests/fuzz/fuzz_tiktoken). Real vocabularies have at most a few 100k ids.
  constexpr int32_t kMaxId = (1 << 22) - 1;
  LOOM_CHECK(id <= kMaxId, what, ": token id ", id, " is too large; expected ids up to ", kMaxId,
             " (a vocabulary of at most 4M tokens)");
  if (size_t(id) >= tokens.size()) {
    tokens.resize(size_t(id) + 1);
    kinds.resize(size_t(id) + 1, tok::kHole);
  }
  LOOM_CHECK(kinds[id] == tok::kHole, what, ": id ", id, " is given twice (",
             tokens[id].size() < 64 ? tokens[id] : tokens[id].substr(0, 64), ")");
  tokens[id] = std::move(bytes);
  kinds[id] = kind;
}

void Tokenizer::Impl::finish(const std::string& what) {
  index.build(tokens, kinds);
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (kinds[id] != tok::kNormal) continue;
    const int32_t first = index.find(tokens, tokens[id]);
    LOOM_CHECK(first == int32_t(id), what, ": ids ", first, " and ", id,
               " are the same token; expected distinct tokens");
  }
  for (int b = 0; b < 256; ++b) {
    const char c = char(b);
    byte_ids[b] = index.find(tokens, std::string_view(&c, 1));
    LOOM_CHECK(byte_ids[b] >= 0, what, ": no token for the byte 0x", "0123456789abcdef"[b >> 4],
               "0123456789abcdef"[b & 15], "; a byte-level BPE vocabulary has all 256 bytes");
  }
  LOOM_CHECK(!pattern.empty(), what, ": no split pattern");
  split =
      tok::Regex(pattern, PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY,
                 "split pattern of " + what);
  std::sort(specials.begin(), specials.end());
  eot = -1;
  for (const auto& [text, id] : specials) {
    LOOM_CHECK(!text.empty(), what, ": special token ", id, " has empty text");
    if (text == "<|endoftext|>" || (text == "<|end_of_text|>" && eot < 0)) eot = id;
  }
  special_re = tok::Regex();
  if (!specials.empty()) {
    // Longest first, so that a special that is a prefix of another does not hide it.
    std::vector<const std::string*> order;
    for (const auto& s : specials) order.push_back(&s.first);
    std::stable_sort(order.begin(), order.end(), [](const std::string* a, const std::string* b) {
      return a->size() > b->size();
    });
    std::string alt;
    for (const std::string* s : order) {
      if (!alt.empty()) alt += '|';
      for (char c : *s) {
        const unsigned char u = c;
        if (u < 0x80 && !std::isalnum(u)) alt += '\\';  // escaped punctuation is literal
        alt += c;
      }
    }
    special_re = tok::Regex(alt, 0, "special tokens of " + what);
  }
}

void Tokenizer::Impl::encode_ordinary(std::string_view text, tok::Matcher& m,
                                      tok::PieceCache& cache, std::vector<int32_t>& out) const {
  std::vector<int32_t> ids;
  std::vector<uint64_t> ranks;
  const char* s = text.data();
  tok::split_pieces(m, s, text.size(), [&](size_t b, size_t e) {
    const std::string_view piece(s + b, e - b);
    const size_t n = piece.size();
    if (n == 1) {
      out.push_back(byte_ids[static_cast<unsigned char>(piece[0])]);
      return;
    }
    const uint64_t h = tok::hash_bytes(piece.data(), n);
    int cached = 0;
    if (const int32_t* hit = cache.find(piece, h, &cached)) {
      out.insert(out.end(), hit, hit + cached);
      return;
    }
    if (ignore_merges) {
      const int32_t id = index.find(tokens, piece, h);
      if (id >= 0) {
        out.push_back(id);
        cache.insert(piece, h, &id, 1);
        return;
      }
    }
    if (ids.size() < n) {
      ids.resize(n);
      ranks.resize(n);
    }
    for (size_t i = 0; i < n; ++i) ids[i] = byte_ids[static_cast<unsigned char>(piece[i])];
    const int m2 = int(n) < tok::kHeapFrom ? tok::bpe_scan(pairs, ids.data(), int(n), ranks.data())
                                           : tok::bpe_heap(pairs, ids.data(), int(n));
    out.insert(out.end(), ids.begin(), ids.begin() + m2);
    cache.insert(piece, h, ids.data(), m2);
  });
}

// ------------------------------------------------------------------------------- API

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  const Impl& im = *impl_;
  LOOM_CHECK(im.split, "Tokenizer::encode: the tokenizer is empty; load() or train() one first");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 16);
  tok::Matcher m(im.split);
  tok::PieceCache cache;
  if (!allow_special || !im.special_re) {
    im.encode_ordinary(text, m, cache, out);
    return out;
  }
  tok::Matcher sm(im.special_re);
  size_t pos = 0, b = 0, e = 0;
  while (pos < text.size() && sm.find(text.data(), text.size(), pos, &b, &e)) {
    im.encode_ordinary(text.substr(pos, b - pos), m, cache, out);
    const std::string_view name = text.substr(b, e - b);
    const auto it = std::lower_bound(
        im.specials.begin(), im.specials.end(), name,
        [](const std::pair<std::string, int32_t>& a, std::string_view n) { return a.first < n; });
    out.push_back(it->second);
    pos = e;
  }
  if (pos < text.size()) im.encode_ordinary(text.substr(pos), m, cache, out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& im = *impl_;
  size_t n = 0;
  for (int32_t id : ids) {
    LOOM_CHECK(id >= 0 && size_t(id) < im.tokens.size() && im.kinds[id] != tok::kHole,
               "Tokenizer::decode: id ", id, " is not in the vocabulary (ids 0..",
               int64_t(im.tokens.size()) - 1, ")");
    n += im.tokens[id].size();
  }
  std::string out;
  out.reserve(n);
  for (int32_t id : ids) out += im.tokens[id];
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  const Impl& im = *impl_;
  LOOM_CHECK(id >= 0 && size_t(id) < im.tokens.size() && im.kinds[id] != tok::kHole,
             "Tokenizer::token_bytes: id ", id, " is not in the vocabulary");
  return im.tokens[id];
}

int64_t Tokenizer::vocab_size() const {
  return int64_t(impl_->tokens.size());
}

int32_t Tokenizer::special_id(const std::string& name) const {
  const auto& sp = impl_->specials;
  const auto it = std::lower_bound(
      sp.begin(), sp.end(), name,
      [](const std::pair<std::string, int32_t>& a, const std::string& n) { return a.first < n; });
  return it != sp.end() && it->first == name ? it->second : -1;
}

int32_t Tokenizer::eot_id() const {
  return impl_->eot;
}

}  // namespace loom
