// Tokenizer files: tiktoken rank files, GPT-2 encoder.json + vocab.bpe, Hugging Face
// tokenizer.json (load and save).
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.hpp"
#include "data/tokenizer.hpp"
#include "data/tokenizer_impl.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Impl = Tokenizer::Impl;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f, "Tokenizer::load: cannot open ", path);
  f.seekg(0, std::ios::end);
  const std::streamoff n = f.tellg();
  f.seekg(0, std::ios::beg);
  std::string s(size_t(std::max<std::streamoff>(n, 0)), '\0');
  f.read(s.data(), n);
  LOOM_CHECK(f, "Tokenizer::load: cannot read ", path);
  return s;
}

// Enough of a long line or key to recognize it in an error message.
std::string clip(std::string_view s) {
  return s.size() <= 80 ? std::string(s) : std::string(s.substr(0, 77)) + "...";
}

std::string hex_cp(char32_t c) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "U+%04X", unsigned(c));
  return buf;
}

json parse_json(const std::string& text, const std::string& path) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    size_t line = 1, col = 1;
    for (size_t i = 0; i + 1 < e.byte && i < text.size(); ++i) {
      if (text[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    fail(path, ":", line, ":", col, ": malformed JSON (", e.what(), ")");
  } catch (const json::exception& e) {
    // Not a syntax error but a value nlohmann cannot hold: a number past a double's range
    // (out_of_range 406), found by fuzz_gpt2_vocab.
    fail(path, ": malformed JSON (", e.what(), ")");
  }
}

bool decode_base64(std::string_view s, std::string* out) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out->clear();
  if (s.empty() || s.size() % 4 != 0) return false;
  size_t pad = 0;
  while (pad < 2 && s[s.size() - 1 - pad] == '=') ++pad;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < s.size() - pad; ++i) {
    const int v = val(s[i]);
    if (v < 0) return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      *out += char((acc >> bits) & 0xFF);
    }
  }
  return !out->empty();
}

template <class F>
void for_each_line(const std::string& text, F&& f) {
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(++line_no, line);
    pos = eol + 1;
  }
}

// Every pair of tokens whose concatenation is a token merges into it, at that token's rank:
// tiktoken's rule, spelt as a merge table (Hugging Face's conversion of Llama 3 does the same).
void merges_from_ranks(Impl& im) {
  for (size_t id = 0; id < im.tokens.size(); ++id) {
    if (im.kinds[id] != tok::kNormal) continue;
    const std::string_view t = im.tokens[id];
    for (size_t k = 1; k < t.size(); ++k) {
      const int32_t l = im.index.find(im.tokens, t.substr(0, k));
      if (l < 0) continue;
      const int32_t r = im.index.find(im.tokens, t.substr(k));
      if (r >= 0) im.pairs.insert(l, r, tok::merge_value(uint32_t(id), int32_t(id)));
    }
  }
}

void add_specials(Impl& im, const std::unordered_map<std::string, int32_t>& specials,
                  const std::string& what) {
  for (const auto& [text, id] : specials) {
    if (size_t(id) < im.kinds.size() && im.kinds[id] == tok::kSpecial && im.tokens[id] == text) {
      continue;  // already in the file
    }
    im.set_token(id, text, tok::kSpecial, what + ": special token " + text);
    im.specials.emplace_back(text, id);
  }
}

void load_tiktoken(Impl& im, const std::string& text, const std::string& path) {
  std::string bytes;
  for_each_line(text, [&](size_t line_no, std::string_view line) {
    if (line.find_first_not_of(" \t") == std::string_view::npos) return;
    const size_t sp = line.find(' ');
    const std::string where = path + ":" + std::to_string(line_no);
    LOOM_CHECK(sp != std::string_view::npos && sp > 0, where,
               ": expected \"<base64 token> <rank>\", got \"", clip(line), "\"");
    LOOM_CHECK(decode_base64(line.substr(0, sp), &bytes), where, ": \"", clip(line.substr(0, sp)),
               "\" is not base64 of a non-empty token");
    const std::string_view num = line.substr(sp + 1);
    int64_t rank = -1;
    const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), rank);
    LOOM_CHECK(ec == std::errc() && end == num.data() + num.size() && rank >= 0 &&
                   rank < (int64_t(1) << 31),
               where, ": rank \"", clip(num), "\" is not an integer in [0, 2^31)");
    im.set_token(int32_t(rank), bytes, tok::kNormal, where);
  });
  LOOM_CHECK(!im.tokens.empty(), path, ": no tokens; expected lines \"<base64 token> <rank>\"");
  im.ignore_merges = true;  // tiktoken looks a whole piece up before merging
}

// A tiktoken rank file carries neither its split pattern nor its special tokens; the known ones
// are recognised by content: a 64-bit FNV-1a over (rank, length, bytes) of the tokens in rank
// order. Llama 3's tokenizer.model is cl100k's 100256 tokens followed by 27744 of its own.
struct KnownRanks {
  const char* name;
  size_t count;     // tokens in the file
  uint64_t digest;  // of all tokens; for Llama 3, of those below 100256
  const char* pattern;
  std::vector<std::pair<const char*, int32_t>> specials;  // tiktoken's (or Meta's) special tokens
};

const std::vector<KnownRanks>& known_rank_files() {
  static const std::vector<KnownRanks> k = {
      {"r50k_base (GPT-2)",
       50256,
       0xbbf3327e637498f2ull,
       Tokenizer::kGpt2Pattern,
       {{"<|endoftext|>", 50256}}},
      {"p50k_base",
       50280,
       0x0fb8c76b77ad724aull,
       Tokenizer::kGpt2Pattern,
       {{"<|endoftext|>", 50256}}},
      {"cl100k_base",
       100256,
       0x6601ccc25982de24ull,
       Tokenizer::kCl100kPattern,
       {{"<|endoftext|>", 100257},
        {"<|fim_prefix|>", 100258},
        {"<|fim_middle|>", 100259},
        {"<|fim_suffix|>", 100260},
        {"<|endofprompt|>", 100276}}},
      {"o200k_base",
       199998,
       0x82356ec1651eea3cull,
       Tokenizer::kO200kPattern,
       {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}},
      {"Llama 3 tokenizer.model",
       128000,
       0x6601ccc25982de24ull,
       Tokenizer::kLlama3Pattern,
       {{"<|begin_of_text|>", 128000},
        {"<|end_of_text|>", 128001},
        {"<|start_header_id|>", 128006},
        {"<|end_header_id|>", 128007},
        {"<|eot_id|>", 128009}}},
  };
  return k;
}

// The known rank file `im` holds, or nullptr.
const KnownRanks* recognise_ranks(const Impl& im) {
  size_t count = 0;
  uint64_t all = 14695981039346656037ull, below_100256 = all;
  for (size_t id = 0; id < im.tokens.size(); ++id) {
    if (im.kinds[id] != tok::kNormal) continue;
    ++count;
    const uint32_t head[2] = {uint32_t(id), uint32_t(im.tokens[id].size())};
    std::string rec(reinterpret_cast<const char*>(head), sizeof head);
    rec += im.tokens[id];
    for (unsigned char c : rec) all = (all ^ c) * 1099511628211ull;
    if (id < 100256) below_100256 = all;
  }
  for (const KnownRanks& k : known_rank_files())
    if (k.count == count && k.digest == (count == 128000 ? below_100256 : all)) return &k;
  return nullptr;
}

void load_gpt2(Impl& im, const json& enc, const std::string& enc_path) {
  const fs::path dir = fs::path(enc_path).parent_path();
  std::string merges_path = (dir / "vocab.bpe").string();
  if (!fs::exists(merges_path)) merges_path = (dir / "merges.txt").string();
  LOOM_CHECK(fs::exists(merges_path), enc_path,
             ": a GPT-2 encoder.json needs vocab.bpe (or merges.txt) beside it; found neither in ",
             dir.string());
  std::unordered_map<std::string, int32_t> ids;
  std::string bytes;
  char32_t bad = 0;
  for (const auto& [key, value] : enc.items()) {
    const std::string what = enc_path + ": entry \"" + clip(key) + "\"";
    LOOM_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                   value.get<int64_t>() < (int64_t(1) << 31),
               what, ": expected a non-negative integer id, got ", clip(value.dump()));
    LOOM_CHECK(tok::from_byte_level(key, &bytes, &bad), what, ": character ", hex_cp(bad),
               " is not one of GPT-2's 256 byte symbols");
    const int32_t id = value.get<int32_t>();
    im.set_token(id, bytes, tok::kNormal, what);
    ids.emplace(key, id);
  }
  const std::string text = read_file(merges_path);
  std::vector<uint8_t> made(im.tokens.size(), 0);
  uint32_t rank = 0;
  for_each_line(text, [&](size_t line_no, std::string_view line) {
    if (line.empty() || (line_no == 1 && line[0] == '#')) return;  // "#version: 0.2"
    const std::string where = merges_path + ":" + std::to_string(line_no);
    const size_t sp = line.find(' ');
    LOOM_CHECK(sp != std::string_view::npos && sp > 0 && sp + 1 < line.size() &&
                   line.find(' ', sp + 1) == std::string_view::npos,
               where, ": expected \"<left> <right>\", got \"", clip(line), "\"");
    const std::string a(line.substr(0, sp)), b(line.substr(sp + 1));
    const auto ia = ids.find(a), ib = ids.find(b), iab = ids.find(a + b);
    LOOM_CHECK(ia != ids.end(), where, ": \"", clip(a), "\" is not in ", enc_path);
    LOOM_CHECK(ib != ids.end(), where, ": \"", clip(b), "\" is not in ", enc_path);
    LOOM_CHECK(iab != ids.end(), where, ": the merge \"", clip(a + b), "\" is not in ", enc_path);
    im.pairs.insert(ia->second, ib->second, tok::merge_value(rank++, iab->second));
    made[iab->second] = 1;
  });
  // encoder.json keeps <|endoftext|> among the ordinary entries; what no merge makes and is not
  // a single byte is a special token.
  for (size_t id = 0; id < im.tokens.size(); ++id) {
    if (im.kinds[id] == tok::kNormal && im.tokens[id].size() > 1 && !made[id]) {
      im.kinds[id] = tok::kSpecial;
      im.specials.emplace_back(im.tokens[id], int32_t(id));
    }
  }
}

std::string escape_literal(std::string_view s) {
  std::string out;
  for (char c : s) {
    const unsigned char u = c;
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

// The split pattern of a byte-level pre-tokenizer: ByteLevel (use_regex: GPT-2's pattern) or
// Sequence[Split(Regex, Isolated), ByteLevel(use_regex: false)].
std::string pattern_of(const json& pt, const std::string& path) {
  const std::string expect =
      "; expected ByteLevel or Sequence[Split(Isolated), ByteLevel] (byte-level BPE)";
  LOOM_CHECK(pt.is_object(), path, ": pre_tokenizer is ", pt.is_null() ? "null" : pt.dump(),
             expect);
  std::vector<json> list;
  if (pt.value("type", "") == "Sequence") {
    LOOM_CHECK(pt.contains("pretokenizers") && pt["pretokenizers"].is_array(), path,
               ": pre_tokenizer Sequence has no \"pretokenizers\" array");
    for (const json& p : pt["pretokenizers"]) list.push_back(p);
  } else {
    list.push_back(pt);
  }
  std::string pattern;
  bool byte_level = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& p = list[i];
    const std::string where = path + ": pre_tokenizer " + std::to_string(i);
    LOOM_CHECK(p.is_object() && p.contains("type") && p["type"].is_string(), where,
               ": expected an object with a \"type\"");
    const std::string type = p["type"];
    if (type == "Split") {
      LOOM_CHECK(pattern.empty(), where, ": a second splitting step is not supported", expect);
      LOOM_CHECK(p.value("behavior", "") == "Isolated" && !p.value("invert", false), where,
                 ": Split with behavior ", p.value("behavior", std::string("?")),
                 p.value("invert", false) ? ", inverted" : "", " is not supported", expect);
      const json& pat = p.contains("pattern") ? p["pattern"] : json();
      if (pat.contains("Regex") && pat["Regex"].is_string()) {
        pattern = pat["Regex"].get<std::string>();
      } else if (pat.contains("String") && pat["String"].is_string()) {
        pattern = escape_literal(pat["String"].get<std::string>());
      } else {
        fail(where, ": Split has no pattern {\"Regex\": ...} or {\"String\": ...}");
      }
    } else if (type == "ByteLevel") {
      LOOM_CHECK(!p.value("add_prefix_space", false), where,
                 ": ByteLevel with add_prefix_space is not supported");
      if (p.value("use_regex", true)) {
        LOOM_CHECK(pattern.empty(), where, ": a second splitting step is not supported", expect);
        pattern = Tokenizer::kGpt2Pattern;
      }
      byte_level = true;
    } else {
      fail(where, ": pre-tokenizer type ", type, " is not supported", expect);
    }
  }
  LOOM_CHECK(byte_level, path, ": no ByteLevel pre-tokenizer", expect);
  LOOM_CHECK(!pattern.empty(), path, ": the pre-tokenizer does not split the text", expect);
  return pattern;
}

void load_hf(Impl& im, const json& j, const std::string& path) {
  const json& model = j["model"];
  LOOM_CHECK(model.is_object(), path, ": \"model\" is not an object");
  const std::string type = model.value("type", "BPE");
  LOOM_CHECK(type == "BPE", path, ": model type ", type, " is not supported; expected BPE");
  LOOM_CHECK(!model.value("byte_fallback", false), path,
             ": model.byte_fallback is not supported (expected a byte-level BPE)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    LOOM_CHECK(!model.contains(key) || model[key].is_null() ||
                   (model[key].is_string() && model[key].get<std::string>().empty()),
               path, ": model.", key, " is not supported");
  }
  LOOM_CHECK(!model.contains("dropout") || model["dropout"].is_null() ||
                 (model["dropout"].is_number() && model["dropout"].get<double>() == 0.0),
             path, ": BPE dropout is not supported");
  LOOM_CHECK(!j.contains("normalizer") || j["normalizer"].is_null(), path, ": normalizer ",
             clip(j["normalizer"].dump()), " is not supported; expected null");
  LOOM_CHECK(model.contains("vocab") && model["vocab"].is_object(), path,
             ": model.vocab is missing or not an object");
  LOOM_CHECK(model.contains("merges") && model["merges"].is_array(), path,
             ": model.merges is missing or not an array");

  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const json& added = j["added_tokens"];
    LOOM_CHECK(added.is_array(), path, ": added_tokens is not an array");
    for (size_t i = 0; i < added.size(); ++i) {
      const json& a = added[i];
      const std::string where = path + ": added_tokens[" + std::to_string(i) + "]";
      LOOM_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() &&
                     a.contains("content") && a["content"].is_string(),
                 where, ": expected {\"id\": integer, \"content\": string, ...}");
      const std::string content = a["content"];
      const int64_t id = a["id"];
      LOOM_CHECK(id >= 0 && id < (int64_t(1) << 31), where, ": id ", id, " is out of range");
      im.set_token(int32_t(id), content, tok::kSpecial, where);
      im.specials.emplace_back(content, int32_t(id));
    }
  }

  std::unordered_map<std::string, int32_t> ids;
  ids.reserve(model["vocab"].size());
  std::string bytes;
  char32_t bad = 0;
  for (const auto& [key, value] : model["vocab"].items()) {
    const std::string what = path + ": model.vocab entry \"" + clip(key) + "\"";
    LOOM_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                   value.get<int64_t>() < (int64_t(1) << 31),
               what, ": expected a non-negative integer id, got ", clip(value.dump()));
    const int32_t id = value.get<int32_t>();
    ids.emplace(key, id);
    if (size_t(id) < im.kinds.size() && im.kinds[id] == tok::kSpecial) {
      // GPT-2's tokenizer.json lists <|endoftext|> in the vocab and in added_tokens.
      LOOM_CHECK(tok::from_byte_level(key, &bytes, &bad) && bytes == im.tokens[id], what, ": id ",
                 id, " is also added token \"", clip(im.tokens[id]), "\"");
      continue;
    }
    LOOM_CHECK(tok::from_byte_level(key, &bytes, &bad), what, ": character ", hex_cp(bad),
               " is not one of the 256 byte-level symbols (expected a byte-level BPE vocabulary)");
    im.set_token(id, bytes, tok::kNormal, what);
  }

  const json& merges = model["merges"];
  im.pairs.reserve(merges.size());
  std::string a, b;
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    const std::string where = path + ": model.merges[" + std::to_string(i) + "]";
    if (m.is_string()) {  // "left right" (older files)
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      LOOM_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size() &&
                     s.find(' ', sp + 1) == std::string::npos,
                 where, ": expected \"<left> <right>\", got \"", clip(s), "\"");
      a.assign(s, 0, sp);
      b.assign(s, sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();  // ["left", "right"] (tokenizers >= 0.20)
      b = m[1].get<std::string>();
    } else {
      fail(where, ": expected \"<left> <right>\" or [\"<left>\", \"<right>\"], got ",
           clip(m.dump()));
    }
    const auto ia = ids.find(a), ib = ids.find(b), iab = ids.find(a + b);
    LOOM_CHECK(ia != ids.end(), where, ": \"", clip(a), "\" is not in model.vocab");
    LOOM_CHECK(ib != ids.end(), where, ": \"", clip(b), "\" is not in model.vocab");
    LOOM_CHECK(iab != ids.end(), where, ": the merge \"", clip(a + b), "\" is not in model.vocab");
    im.pairs.insert(ia->second, ib->second, tok::merge_value(uint32_t(i), iab->second));
  }
  im.ignore_merges = model.value("ignore_merges", false);
  im.pattern = pattern_of(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(), path);
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path, const std::string& pattern,
                          const std::unordered_map<std::string, int32_t>& specials) {
  Tokenizer t;
  Impl& im = *t.impl_;
  const std::string text = read_file(path);
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool is_json = first != std::string::npos && text[first] == '{';
  bool unknown_ranks = false;
  if (is_json) {
    const json j = parse_json(text, path);
    if (j.contains("model") && j["model"].is_object()) {
      load_hf(im, j, path);
    } else {
      load_gpt2(im, j, path);
      im.pattern = kGpt2Pattern;
    }
  } else {
    load_tiktoken(im, text, path);
    if (const KnownRanks* k = recognise_ranks(im)) {
      im.pattern = k->pattern;
      std::unordered_map<std::string, int32_t> own;
      for (const auto& [name, id] : k->specials) own.emplace(name, id);
      add_specials(im, own, path + " (" + k->name + ")");
    } else {
      unknown_ranks = true;
      im.pattern = kCl100kPattern;  // only until the file is checked through (finish below)
    }
  }
  if (!pattern.empty()) im.pattern = pattern;
  add_specials(im, specials, path);
  im.finish(path);
  // After the file's own errors, which name its lines.
  LOOM_CHECK(!unknown_ranks || !pattern.empty(), path,
             ": a tiktoken rank file that loom does not recognise (known by content: r50k_base, "
             "p50k_base, cl100k_base, o200k_base, Llama 3 tokenizer.model); a rank file holds no "
             "split pattern, so give one (--split-pattern gpt2, cl100k, o200k, llama3 or a regex)");
  if (!is_json) merges_from_ranks(im);
  return t;
}

std::string Tokenizer::pattern_named(const std::string& name) {
  if (name == "gpt2" || name == "r50k" || name == "p50k") return kGpt2Pattern;
  if (name == "cl100k") return kCl100kPattern;
  if (name == "o200k") return kO200kPattern;
  if (name == "llama3") return kLlama3Pattern;
  return name;
}

void Tokenizer::save(const std::string& path) const {
  const Impl& im = *impl_;
  LOOM_CHECK(im.split, "Tokenizer::save: the tokenizer is empty");
  std::vector<std::pair<int32_t, std::string>> specials;
  for (const auto& [text, id] : im.specials) specials.emplace_back(id, text);
  std::sort(specials.begin(), specials.end());
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (const auto& [id, text] : specials) {
    added.push_back({{"id", id},
                     {"content", text},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  nlohmann::ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = std::move(added);
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"Regex", im.pattern}}},
                           {"behavior", "Isolated"},
                           {"invert", false}},
                          {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", false}}}}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"},
                  {"add_prefix_space", true},
                  {"trim_offsets", true},
                  {"use_regex", true}};
  std::string text;
  try {
    text = j.dump(1);
  } catch (const nlohmann::json::exception& e) {
    fail("Tokenizer::save: ", path, ": a special token is not valid UTF-8 (", e.what(), ")");
  }
  // The model is written by hand: vocab and merges have 10^5 entries, and an ordered JSON object
  // inserts in linear time. Byte-level strings are valid UTF-8, so quoting cannot fail.
  auto quote = [](const std::string& s) { return nlohmann::json(s).dump(); };
  text.resize(text.size() - 2);  // "\n}"
  text += ",\n \"model\": {\n  \"type\": \"BPE\",\n  \"dropout\": null,\n  \"unk_token\": null,\n";
  text += "  \"continuing_subword_prefix\": null,\n  \"end_of_word_suffix\": null,\n";
  text += "  \"fuse_unk\": false,\n  \"byte_fallback\": false,\n";
  text += std::string("  \"ignore_merges\": ") + (im.ignore_merges ? "true" : "false") + ",\n";
  text += "  \"vocab\": {";
  const char* sep = "\n   ";
  for (size_t id = 0; id < im.tokens.size(); ++id) {
    if (im.kinds[id] != tok::kNormal) continue;
    text += sep + quote(tok::to_byte_level(im.tokens[id])) + ": " + std::to_string(id);
    sep = ",\n   ";
  }
  text += "\n  },\n  \"merges\": [";
  auto items = im.pairs.items();
  std::sort(items.begin(), items.end(), [](const auto& x, const auto& y) {
    return x.second != y.second ? x.second < y.second : x.first < y.first;
  });
  sep = "\n   ";
  for (const auto& [key, merge] : items) {
    text += sep + quote(tok::to_byte_level(im.tokens[key >> 32]) + " " +
                        tok::to_byte_level(im.tokens[uint32_t(key)]));
    sep = ",\n   ";
  }
  text += "\n  ]\n }\n}\n";
  // Written beside and renamed, so a crash never leaves a half-written tokenizer.json.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    LOOM_CHECK(f, "Tokenizer::save: cannot create ", tmp);
    f.write(text.data(), std::streamsize(text.size()));
    LOOM_CHECK(f.flush(), "Tokenizer::save: cannot write ", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  LOOM_CHECK(!ec, "Tokenizer::save: cannot rename ", tmp, " to ", path, ": ", ec.message());
}

}  // namespace loom
