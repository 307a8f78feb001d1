// BPE training: count the pieces of the corpus, then merge the most frequent pair repeatedly,
// updating the pair counts of only the words that contain the merged pair.
#include <algorithm>
#include <queue>
#include <unordered_map>

#include "core/error.hpp"
#include "data/tokenizer.hpp"
#include "data/tokenizer_impl.hpp"

namespace loom {

namespace {

struct Candidate {
  int64_t count;
  uint64_t pair;
  // The heap's top is the largest count; among equal counts the smallest (left, right) ids, so
  // the result does not depend on hash order.
  bool operator<(const Candidate& o) const {
    return count != o.count ? count < o.count : pair > o.pair;
  }
};

}  // namespace

Tokenizer Tokenizer::train(std::string_view text, int64_t vocab_size,
                           const std::vector<std::string>& specials, const std::string& pattern) {
  const int64_t n_merges = vocab_size - 256 - int64_t(specials.size());
  LOOM_CHECK(n_merges >= 0, "Tokenizer::train: vocab_size ", vocab_size, " is below 256 bytes + ",
             specials.size(), " special tokens");
  LOOM_CHECK(vocab_size < (int64_t(1) << 31), "Tokenizer::train: vocab_size ", vocab_size,
             " does not fit 32-bit ids");
  const std::string what = "Tokenizer::train";
  for (size_t i = 0; i < specials.size(); ++i) {
    LOOM_CHECK(!specials[i].empty(), what, ": special token ", i, " is empty");
    for (size_t k = 0; k < i; ++k) {
      LOOM_CHECK(specials[k] != specials[i], what, ": special token ", specials[i],
                 " is listed twice");
    }
  }

  Tokenizer t;
  Impl& im = *t.impl_;
  im.pattern = pattern;
  for (int b = 0; b < 256; ++b) im.set_token(b, std::string(1, char(b)), tok::kNormal, what);
  // Specials are placed after the merges once their number is known; finish() needs them now to
  // build the regex that cuts them out of the corpus, so it runs on a scratch tokenizer first.
  {
    Tokenizer scratch;
    Impl& sc = *scratch.impl_;
    sc.tokens = im.tokens;
    sc.kinds = im.kinds;
    sc.pattern = pattern;
    for (size_t i = 0; i < specials.size(); ++i) {
      sc.set_token(int32_t(256 + i), specials[i], tok::kSpecial, what + ": special " + specials[i]);
      sc.specials.emplace_back(specials[i], int32_t(256 + i));
    }
    sc.finish(what);
    im.split = std::move(sc.split);
    im.special_re = std::move(sc.special_re);
  }

  // 1. Word counts. The corpus is cut at special tokens, which are never learned from.
  std::unordered_map<std::string_view, int64_t> word_counts;
  {
    tok::Matcher m(im.split);
    auto count_segment = [&](std::string_view seg) {
      tok::split_pieces(m, seg.data(), seg.size(),
                        [&](size_t b, size_t e) { ++word_counts[seg.substr(b, e - b)]; });
    };
    if (im.special_re) {
      tok::Matcher sm(im.special_re);
      size_t pos = 0, b = 0, e = 0;
      while (pos < text.size() && sm.find(text.data(), text.size(), pos, &b, &e)) {
        count_segment(text.substr(pos, b - pos));
        pos = e;
      }
      if (pos < text.size()) count_segment(text.substr(pos));
    } else {
      count_segment(text);
    }
  }
  std::vector<std::pair<std::string_view, int64_t>> sorted(word_counts.begin(), word_counts.end());
  std::sort(sorted.begin(), sorted.end());
  word_counts.clear();
  std::vector<std::vector<int32_t>> words(sorted.size());
  std::vector<int64_t> counts(sorted.size());
  for (size_t w = 0; w < sorted.size(); ++w) {
    for (unsigned char c : sorted[w].first) words[w].push_back(c);
    counts[w] = sorted[w].second;
  }

  // 2. Pair counts and, per pair, the words it occurs in (entries may go stale; a merge rescans
  // the word anyway).
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;
  auto note_word = [&](uint64_t key, int32_t w) {
    std::vector<int32_t>& ws = pair_words[key];
    if (ws.empty() || ws.back() != w) ws.push_back(w);
  };
  for (size_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w];
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t key = tok::pair_key(s[i], s[i + 1]);
      pair_count[key] += counts[w];
      note_word(key, int32_t(w));
    }
  }
  std::priority_queue<Candidate> heap;
  for (const auto& [key, c] : pair_count) heap.push({c, key});

  // 3. Merges. A pair's count only falls after it first appears (merges only break adjacencies,
  // except those of the new token), so a heap entry whose count is stale is pushed back with the
  // current count and the top is the true maximum once its count is current.
  std::vector<int32_t> merged;
  std::vector<uint64_t> touched;
  for (int64_t r = 0; r < n_merges && !heap.empty();) {
    const Candidate top = heap.top();
    heap.pop();
    const auto it = pair_count.find(top.pair);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {
      if (current > 0) heap.push({current, top.pair});
      continue;
    }
    if (current <= 0) break;
    const int32_t a = int32_t(top.pair >> 32), b = int32_t(uint32_t(top.pair));
    const int32_t id = int32_t(im.tokens.size());
    im.set_token(id, im.tokens[a] + im.tokens[b], tok::kNormal, what);
    im.pairs.insert(a, b, tok::merge_value(uint32_t(r), id));
    ++r;

    touched.clear();
    const std::vector<int32_t> ws = std::move(pair_words[top.pair]);
    pair_words.erase(top.pair);
    for (int32_t w : ws) {
      std::vector<int32_t>& s = words[w];
      bool has = false;
      for (size_t i = 0; i + 1 < s.size() && !has; ++i) has = s[i] == a && s[i + 1] == b;
      if (!has) continue;
      const int64_t c = counts[w];
      for (size_t i = 0; i + 1 < s.size(); ++i) pair_count[tok::pair_key(s[i], s[i + 1])] -= c;
      merged.clear();
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          merged.push_back(id);
          i += 2;
        } else {
          merged.push_back(s[i++]);
        }
      }
      s.swap(merged);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t key = tok::pair_key(s[i], s[i + 1]);
        pair_count[key] += c;
        if (s[i] == id || s[i + 1] == id) {
          note_word(key, w);
          touched.push_back(key);
        }
      }
    }
    pair_count.erase(top.pair);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (uint64_t key : touched) heap.push({pair_count[key], key});
  }

  for (const std::string& s : specials) {
    const int32_t id = int32_t(im.tokens.size());
    im.set_token(id, s, tok::kSpecial, what + ": special " + s);
    im.specials.emplace_back(s, id);
  }
  im.finish(what);
  return t;
}

}  // namespace loom
