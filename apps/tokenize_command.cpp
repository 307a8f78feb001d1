// `loom tokenize`: text or JSONL files -> token shards (data/token_shard.hpp) of a train and a
// val split, with the tokenizer that made them and a meta.json beside them.
//
// A document is a whole text file or one JSONL line (its "text" field); each is encoded and
// followed by the tokenizer's end-of-text id, so documents stay separated in the stream the data
// loader cuts windows from. The val split is the last F of the documents when both splits get at
// least two of them (a held-out set of whole documents), else the last F of the tokens (one big
// text, where the only held-out data there can be is its end).
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "data/token_shard.hpp"
#include "data/tokenizer.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char* kTokenizeUsage =
    "usage: loom tokenize --input FILE... --output DIR\n"
    "                     (--tokenizer FILE | --train-vocab N --save-tokenizer FILE)\n"
    "                     [--split-pattern P] [--val-fraction F] [--shard-tokens N]\n"
    "  --input FILE...       text files (one document each) or .jsonl files (one JSON object\n"
    "                        per line with a \"text\" field)\n"
    "  --output DIR          writes DIR/train-00000.bin ..., DIR/val-00000.bin ...,\n"
    "                        DIR/tokenizer.json and DIR/meta.json\n"
    "  --tokenizer FILE      tokenizer.json, tiktoken rank file, or GPT-2 encoder.json\n"
    "  --split-pattern P     the pre-tokenizer: gpt2, cl100k, o200k, llama3 or a PCRE2 regex\n"
    "                        (needed for a rank file other than r50k/p50k/cl100k/o200k_base or\n"
    "                        Llama 3's tokenizer.model, which are recognised by content)\n"
    "  --train-vocab N       train a byte-level BPE vocabulary of N ids on the inputs instead,\n"
    "  --save-tokenizer FILE   and save it to FILE\n"
    "  --val-fraction F      last fraction of the documents (or of the tokens, when there are\n"
    "                        too few documents) held out as the val split (default 0)\n"
    "  --shard-tokens N      at most N tokens per shard (default 100000000)\n";

constexpr uint64_t kBatchBytes = uint64_t(32) << 20;  // text read per parallel encode
constexpr size_t kBatchDocs = 16384;
constexpr int kMaxShards = 100000;  // five-digit names keep name order == stream order

struct Options {
  std::vector<std::string> inputs;
  std::string output, tokenizer, save_tokenizer, split_pattern;
  int64_t train_vocab = 0;
  double val_fraction = 0.0;
  uint64_t shard_tokens = 100000000;
};

bool starts_with(const std::string& s, const char* p) {
  return s.rfind(p, 0) == 0;
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  int64_t x = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  LOOM_CHECK(r.ec == std::errc() && r.ptr == v.data() + v.size() && x >= 1, flag,
             " expects a positive integer, got '", v, "'");
  return x;
}

double parse_fraction(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  LOOM_CHECK(!v.empty() && end == v.c_str() + v.size() && x >= 0.0 && x < 1.0, flag,
             " expects a number in [0, 1), got '", v, "'");
  return x;
}

Options parse_options(const Args& args) {
  Options o;
  bool have_vocab = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--input") {
      const size_t before = o.inputs.size();
      while (i + 1 < args.size() && !starts_with(args[i + 1], "--")) o.inputs.push_back(args[++i]);
      LOOM_CHECK(o.inputs.size() > before, "--input needs at least one FILE\n", kTokenizeUsage);
      continue;
    }
    if (starts_with(a, "--input=")) {
      o.inputs.push_back(a.substr(8));
      continue;
    }
    std::string key = a, value;
    const size_t eq = a.find('=');
    const bool inline_value = starts_with(a, "--") && eq != std::string::npos;
    if (inline_value) {
      key = a.substr(0, eq);
      value = a.substr(eq + 1);
    }
    const bool known = key == "--output" || key == "--tokenizer" || key == "--train-vocab" ||
                       key == "--save-tokenizer" || key == "--val-fraction" ||
                       key == "--shard-tokens" || key == "--split-pattern";
    LOOM_CHECK(known, "unknown argument '", a, "'\n", kTokenizeUsage);
    if (!inline_value) {
      LOOM_CHECK(i + 1 < args.size(), key, " needs a value\n", kTokenizeUsage);
      value = args[++i];
    }
    if (key == "--output") {
      o.output = value;
    } else if (key == "--tokenizer") {
      o.tokenizer = value;
    } else if (key == "--train-vocab") {
      o.train_vocab = parse_int(key, value);
      have_vocab = true;
    } else if (key == "--split-pattern") {
      LOOM_CHECK(!value.empty(),
                 "--split-pattern needs a pattern (gpt2, cl100k, o200k, llama3 or "
                 "a regex)");
      o.split_pattern = Tokenizer::pattern_named(value);
    } else if (key == "--save-tokenizer") {
      o.save_tokenizer = value;
    } else if (key == "--val-fraction") {
      o.val_fraction = parse_fraction(key, value);
    } else {
      o.shard_tokens = uint64_t(parse_int(key, value));
    }
  }
  LOOM_CHECK(!o.inputs.empty(), "no input: give --input FILE...\n", kTokenizeUsage);
  LOOM_CHECK(!o.output.empty(), "no output directory: give --output DIR\n", kTokenizeUsage);
  LOOM_CHECK(o.tokenizer.empty() || !have_vocab,
             "give either --tokenizer FILE or --train-vocab N, not both");
  LOOM_CHECK(!o.tokenizer.empty() || have_vocab,
             "no tokenizer: give --tokenizer FILE, or --train-vocab N --save-tokenizer FILE\n",
             kTokenizeUsage);
  LOOM_CHECK(!have_vocab || !o.save_tokenizer.empty(),
             "--train-vocab needs --save-tokenizer FILE (where the trained tokenizer goes)");
  LOOM_CHECK(have_vocab || o.save_tokenizer.empty(),
             "--save-tokenizer only goes with --train-vocab N");
  return o;
}

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

struct Input {
  std::string path;
  bool jsonl = false;
  uint64_t bytes = 0;
  int64_t documents = 0;
};

std::vector<Input> scan_inputs(const std::vector<std::string>& paths) {
  std::vector<Input> inputs;
  for (const auto& p : paths) {
    std::error_code ec;
    const auto st = fs::status(p, ec);
    LOOM_CHECK(fs::exists(st), "input file '", p, "' does not exist");
    LOOM_CHECK(fs::is_regular_file(st), "input '", p, "' is not a regular file");
    Input in;
    in.path = p;
    in.jsonl = fs::path(p).extension() == ".jsonl";
    in.bytes = fs::file_size(p, ec);
    LOOM_CHECK(!ec, "cannot read the size of input '", p, "': ", ec.message());
    std::ifstream f(p, std::ios::binary);
    LOOM_CHECK(f, "cannot open input '", p, "': ", std::strerror(errno));
    if (in.jsonl) {
      // A pre-pass that only counts documents: the doc split must know their number before
      // the first one is written.
      std::string line;
      while (std::getline(f, line)) in.documents += !is_blank(line);
      LOOM_CHECK(in.documents > 0, "input '", p, "' holds no documents (",
                 in.bytes == 0 ? "it is empty" : "every line is blank",
                 "): expected one JSON object with a \"text\" field per line");
    } else {
      // An empty file would still become a document: a dataset of end-of-text tokens alone.
      LOOM_CHECK(in.bytes > 0, "input '", p, "' is empty: expected text to tokenize");
      in.documents = 1;
    }
    inputs.push_back(in);
  }
  return inputs;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f, "cannot open input '", path, "': ", std::strerror(errno));
  std::string s;
  f.seekg(0, std::ios::end);
  s.resize(size_t(f.tellg()));
  f.seekg(0);
  f.read(s.data(), std::streamsize(s.size()));
  LOOM_CHECK(f || s.empty(), "cannot read input '", path, "'");
  return s;
}

// One document on its way through: raw JSONL line (line > 0) or a whole text file (line == 0).
struct Doc {
  std::string text;
  size_t input = 0;
  int64_t line = 0;
};

// JSONL lines of a batch are parsed in parallel; errors are collected and the first in input
// order is raised, since an exception cannot leave an OpenMP region.
void parse_batch(std::vector<Doc>& docs, const std::vector<Input>& inputs) {
  std::vector<std::string> errors(docs.size());
#pragma omp parallel for schedule(dynamic, 64)
  for (size_t i = 0; i < docs.size(); ++i) {
    Doc& d = docs[i];
    if (d.line == 0) continue;
    const std::string where = str_cat("input '", inputs[d.input].path, "' line ", d.line, ": ");
    try {
      const auto j = nlohmann::json::parse(d.text, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) {
        errors[i] = where + "not valid JSON";
      } else if (!j.is_object()) {
        errors[i] = where + "not a JSON object (expected {\"text\": \"...\"})";
      } else if (!j.contains("text")) {
        errors[i] = where + "no \"text\" field (expected {\"text\": \"...\"})";
      } else if (!j["text"].is_string()) {
        errors[i] = where + "the \"text\" field is not a string";
      } else {
        d.text = j["text"].get<std::string>();
      }
    } catch (const std::exception& e) {
      errors[i] = where + e.what();
    }
  }
  for (const auto& e : errors)
    if (!e.empty()) throw Error(e);
}

// Calls fn with the documents of all inputs in order, in batches of parsed text.
void for_each_batch(const std::vector<Input>& inputs,
                    const std::function<void(std::vector<Doc>&)>& fn) {
  std::vector<Doc> batch;
  uint64_t bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    parse_batch(batch, inputs);
    fn(batch);
    batch.clear();
    bytes = 0;
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].jsonl) {
      batch.push_back({read_file(inputs[k].path), k, 0});
      bytes += batch.back().text.size();
      if (bytes >= kBatchBytes || batch.size() >= kBatchDocs) flush();
      continue;
    }
    std::ifstream f(inputs[k].path, std::ios::binary);
    LOOM_CHECK(f, "cannot open input '", inputs[k].path, "': ", std::strerror(errno));
    std::string line;
    for (int64_t n = 1; std::getline(f, line); ++n) {
      if (is_blank(line)) continue;
      bytes += line.size();
      batch.push_back({std::move(line), k, n});
      if (bytes >= kBatchBytes || batch.size() >= kBatchDocs) flush();
    }
  }
  flush();
}

// Cuts the tokens of one split into shards of at most shard_tokens.
class SplitWriter {
 public:
  SplitWriter(std::string dir, std::string split, uint64_t vocab, uint64_t shard_tokens)
      : dir_(std::move(dir)), split_(std::move(split)), vocab_(vocab), cap_(shard_tokens) {}

  void add(const int32_t* p, uint64_t n) {
    while (n > 0) {
      const uint64_t take = std::min<uint64_t>(n, cap_ - buf_.size());
      buf_.insert(buf_.end(), p, p + take);
      p += take;
      n -= take;
      total_ += take;
      if (buf_.size() == cap_) flush();
    }
  }
  void finish() { flush(); }
  uint64_t tokens() const { return total_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  void flush() {
    if (buf_.empty()) return;
    LOOM_CHECK(int(files_.size()) < kMaxShards, "more than ", kMaxShards, " ", split_,
               " shards; raise --shard-tokens");
    char name[64];
    std::snprintf(name, sizeof name, "%s-%05d.bin", split_.c_str(), int(files_.size()));
    const std::string path = (fs::path(dir_) / name).string();
    write_shard(path, buf_, vocab_);
    files_.push_back(path);
    buf_.clear();
  }

  std::string dir_, split_;
  uint64_t vocab_, cap_, total_ = 0;
  std::vector<int32_t> buf_;
  std::vector<std::string> files_;
};

void prepare_output(const std::string& dir) {
  std::error_code ec;
  LOOM_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "output '", dir,
             "' exists and is not a directory");
  fs::create_directories(dir, ec);
  LOOM_CHECK(!ec, "cannot create the output directory '", dir, "': ", ec.message());
  // Fails now rather than after the whole corpus has been encoded.
  const std::string probe =
      (fs::path(dir) / (".loom-tokenize-probe." + std::to_string(::getpid()))).string();
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  LOOM_CHECK(f, "output directory '", dir, "' is not writable: ", std::strerror(errno));
  std::fclose(f);
  fs::remove(probe, ec);
}

// Writes `text` to path atomically (temporary file, then rename).
void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    LOOM_CHECK(f, "cannot write '", tmp, "': ", std::strerror(errno));
    f << text;
    f.flush();
    LOOM_CHECK(f, "cannot write '", tmp, "'");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp);
    fail("cannot rename '", tmp, "' to '", path, "': ", ec.message());
  }
}

double mb(uint64_t bytes) {
  return double(bytes) / 1e6;
}

}  // namespace

int tokenize_command(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::fputs(kTokenizeUsage, stdout);
      return 0;
    }
  const Options o = parse_options(args);
  const auto t_start = Clock::now();
  const std::vector<Input> inputs = scan_inputs(o.inputs);
  prepare_output(o.output);

  int64_t num_docs = 0;
  uint64_t input_bytes = 0;
  for (const auto& in : inputs) {
    num_docs += in.documents;
    input_bytes += in.bytes;
  }
  LOOM_CHECK(num_docs > 0, "the inputs hold no documents (every JSONL line is blank)");

  Tokenizer tok;
  std::string tokenizer_source;
  double train_s = 0;
  if (o.train_vocab > 0) {
    const auto t0 = Clock::now();
    std::string corpus;
    for_each_batch(inputs, [&](std::vector<Doc>& docs) {
      for (const auto& d : docs) {
        corpus += d.text;
        corpus += '\n';
      }
    });
    std::printf("training a vocabulary of %lld ids on %.2f MB of text...\n",
                (long long)o.train_vocab, mb(corpus.size()));
    std::fflush(stdout);
    tok = o.split_pattern.empty()
              ? Tokenizer::train(corpus, o.train_vocab)
              : Tokenizer::train(corpus, o.train_vocab, {"<|endoftext|>"}, o.split_pattern);
    tok.save(o.save_tokenizer);
    tokenizer_source = o.save_tokenizer;
    train_s = std::chrono::duration<double>(Clock::now() - t0).count();
  } else {
    tok = Tokenizer::load(o.tokenizer, o.split_pattern);
    tokenizer_source = o.tokenizer;
  }
  const uint64_t vocab = uint64_t(tok.vocab_size());
  const int32_t eot = tok.eot_id();
  LOOM_CHECK(eot < int64_t(vocab), "tokenizer '", tokenizer_source, "': end-of-text id ", eot,
             " is not below its vocab_size ", vocab);

  const int64_t val_docs_wanted = std::llround(o.val_fraction * double(num_docs));
  const bool split_by_docs = val_docs_wanted >= 2 && num_docs - val_docs_wanted >= 2;
  const int64_t train_docs = split_by_docs ? num_docs - val_docs_wanted : num_docs;

  const auto t_encode = Clock::now();
  SplitWriter train(o.output, "train", vocab, o.shard_tokens);
  SplitWriter val(o.output, "val", vocab, o.shard_tokens);
  std::vector<int32_t> all;  // the token split must see every token before it can cut
  int64_t doc_index = 0;
  uint64_t text_bytes = 0, total_tokens = 0;
  auto last_report = Clock::now();
  for_each_batch(inputs, [&](std::vector<Doc>& docs) {
    std::vector<std::vector<int32_t>> ids(docs.size());
    // Documents are independent, so they are encoded in parallel (Tokenizer::encode is const).
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = 0; i < docs.size(); ++i) {
      ids[i] = tok.encode(docs[i].text);
      if (eot >= 0) ids[i].push_back(eot);
    }
    for (size_t i = 0; i < docs.size(); ++i, ++doc_index) {
      text_bytes += docs[i].text.size();
      total_tokens += ids[i].size();
      if (!split_by_docs)
        all.insert(all.end(), ids[i].begin(), ids[i].end());
      else
        (doc_index < train_docs ? train : val).add(ids[i].data(), ids[i].size());
    }
    if (Clock::now() - last_report > std::chrono::seconds(10)) {
      last_report = Clock::now();
      std::printf("  %lld/%lld documents, %.1f MB, %llu tokens\n", (long long)doc_index,
                  (long long)num_docs, mb(text_bytes), (unsigned long long)total_tokens);
      std::fflush(stdout);
    }
  });
  if (!split_by_docs) {
    const uint64_t n_val = uint64_t(std::llround(o.val_fraction * double(all.size())));
    LOOM_CHECK(n_val < all.size(), "--val-fraction ", o.val_fraction, " leaves no training tokens");
    train.add(all.data(), all.size() - n_val);
    val.add(all.data() + (all.size() - n_val), n_val);
  }
  train.finish();
  val.finish();
  if (o.val_fraction > 0 && val.tokens() == 0)
    std::printf("note: --val-fraction %g of %llu tokens rounds to none; no val split written\n",
                o.val_fraction, (unsigned long long)total_tokens);
  const double encode_s = std::chrono::duration<double>(Clock::now() - t_encode).count();

  // Shards of an earlier run beyond this run's count would otherwise join the stream.
  std::set<std::string> written(train.files().begin(), train.files().end());
  written.insert(val.files().begin(), val.files().end());
  for (const char* split : {"train", "val"})
    for (const auto& f : TokenStream::find_files(o.output, split))
      if (!written.count(f)) {
        std::error_code ec;
        fs::remove(f, ec);
        LOOM_CHECK(!ec, "cannot remove the stale shard '", f, "': ", ec.message());
        std::printf("removed stale shard %s\n", f.c_str());
      }

  // The copy is re-serialized by save(), so it is a tokenizer.json whatever the source format.
  const std::string tok_copy = (fs::path(o.output) / "tokenizer.json").string();
  std::error_code ec;
  if (!fs::exists(tok_copy, ec) || !fs::equivalent(tokenizer_source, tok_copy, ec)) {
    const std::string tmp = tok_copy + ".tmp." + std::to_string(::getpid());
    tok.save(tmp);
    fs::rename(tmp, tok_copy, ec);
    LOOM_CHECK(!ec, "cannot rename '", tmp, "' to '", tok_copy, "': ", ec.message());
  }

  nlohmann::json meta;
  meta["vocab_size"] = vocab;
  meta["train_tokens"] = train.tokens();
  meta["val_tokens"] = val.tokens();
  meta["inputs"] = o.inputs;
  meta["tokenizer"] = tokenizer_source;
  meta["documents"] = num_docs;
  meta["val_documents"] = split_by_docs ? num_docs - train_docs : 0;
  meta["val_split"] = val.tokens() == 0 ? "none" : split_by_docs ? "documents" : "tokens";
  meta["val_fraction"] = o.val_fraction;
  meta["eot_id"] = eot;
  meta["token_bytes"] = vocab <= 65536 ? 2 : 4;
  meta["shard_tokens"] = o.shard_tokens;
  std::vector<std::string> names;
  for (const auto& f : train.files()) names.push_back(fs::path(f).filename().string());
  meta["train_shards"] = names;
  names.clear();
  for (const auto& f : val.files()) names.push_back(fs::path(f).filename().string());
  meta["val_shards"] = names;
  write_text_atomic((fs::path(o.output) / "meta.json").string(), meta.dump(2) + "\n");

  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  std::printf("%lld documents from %zu input(s), %.2f MB (%.2f MB of text)\n", (long long)num_docs,
              inputs.size(), mb(input_bytes), mb(text_bytes));
  if (o.train_vocab > 0)
    std::printf("trained a vocabulary of %llu ids in %.2f s -> %s\n", (unsigned long long)vocab,
                train_s, o.save_tokenizer.c_str());
  std::printf("%llu tokens (%.2f bytes of text per token), vocab %llu, end-of-text id %d\n",
              (unsigned long long)total_tokens,
              total_tokens ? double(text_bytes) / double(total_tokens) : 0.0,
              (unsigned long long)vocab, eot);
  std::printf("encoded in %.2f s: %.2f MB/s\n", encode_s,
              mb(input_bytes) / std::max(encode_s, 1e-9));
  std::printf("train: %llu tokens in %zu shard(s); val: %llu tokens in %zu shard(s), split by %s\n",
              (unsigned long long)train.tokens(), train.files().size(),
              (unsigned long long)val.tokens(), val.files().size(),
              split_by_docs ? "documents" : "tokens");
  std::printf("wrote %s (%.2f s in all)\n", o.output.c_str(), total_s);
  return 0;
}

}  // namespace loom
