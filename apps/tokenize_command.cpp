// `loom tokenize`: text or JSONL files -> token shards (data/token_shard.hpp) of a train and a
// val split, with the tokenizer that made them and a meta.json beside them.
//
// A document is a whole text file or one JSONL line (its "text" field); each is encoded and
// followed by the tokenizer's end-of-text id, so documents stay separated in the stream the data
// loader cuts windows from. The val split is the last F of the documents when both splits get at
// least two of them (a held-out set of whole documents), else the last F of the tokens (one big
// text, where the only held-out data there can be is its end).
//
// Inputs are read as people have them: files, directories and globs (data/dataset_files.hpp),
// plain or compressed with gzip or zstd (data/compressed_reader.hpp). This run's shards are
// written under a staging directory and moved beside the others only when every document has been
// encoded, so a run that fails half-way leaves none of its own.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "apps/commands.hpp"
#include "apps/progress_line.hpp"
#include "core/error.hpp"
#include "data/compressed_reader.hpp"
#include "data/dataset_files.hpp"
#include "data/token_shard.hpp"
#include "data/tokenizer.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char* kTokenizeUsage =
    "usage: loom tokenize --input PATH... --output DIR\n"
    "                     (--tokenizer FILE | --train-vocab N --save-tokenizer FILE)\n"
    "                     [--split-pattern P] [--val-fraction F] [--shard-tokens N]\n"
    "  --input PATH...       files, directories or glob patterns, in this order:\n"
    "                        x.txt is one document, x.jsonl one per line (a JSON object with a\n"
    "                        \"text\" field); either may be compressed: x.txt.gz, x.jsonl.zst\n"
    "                        (gzip .gz, zstd .zst). A directory gives every *.txt and *.jsonl\n"
    "                        (compressed too) under it, recursively, sorted by path; a quoted\n"
    "                        pattern ('data/*.jsonl.zst') is expanded here, sorted by path\n"
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
    "  --shard-tokens N      at most N tokens per shard (default 100000000)\n"
    "Documents are encoded on every core (OMP_NUM_THREADS); the shards do not depend on the\n"
    "number of threads. Progress goes to stdout: redrawn in place on a terminal, a line every\n"
    "10 s otherwise.\n";

constexpr uint64_t kBatchBytes = uint64_t(32) << 20;  // text read per parallel encode
constexpr size_t kBatchDocs = 16384;
constexpr int kMaxShards = 100000;  // five-digit names keep name order == stream order
// What a directory's files must end in (under .gz or .zst) to be read as inputs.
const std::vector<std::string> kInputSuffixes = {".txt", ".jsonl"};

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
      LOOM_CHECK(o.inputs.size() > before, "--input needs at least one PATH\n", kTokenizeUsage);
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
  LOOM_CHECK(!o.inputs.empty(), "no input: give --input PATH...\n", kTokenizeUsage);
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
  uint64_t bytes = 0;   // of the file, compressed or not
  uint64_t offset = 0;  // file bytes of the inputs before this one: progress is over all of them
  int64_t documents = 0;
};

struct LineCount {
  int64_t non_blank = 0;
  uint64_t bytes = 0;  // of text, decompressed
};

// The non-blank lines of a stream, counted without making a string of each.
LineCount count_lines(CompressedReader& r, const std::function<void()>& on_chunk) {
  std::vector<char> buf(size_t(1) << 20);
  LineCount c;
  bool blank = true;  // the current line, so far
  while (const size_t n = r.read(buf.data(), buf.size())) {
    c.bytes += n;
    const char *p = buf.data(), *e = p + n;
    while (p < e) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', size_t(e - p)));
      const char* le = nl ? nl : e;
      for (const char* q = p; blank && q < le; ++q) blank = *q == ' ' || *q == '\t' || *q == '\r';
      if (!nl) break;
      c.non_blank += !blank;
      blank = true;
      p = nl + 1;
    }
    on_chunk();
  }
  c.non_blank += !blank;
  return c;
}

// Raises the first of errors collected in an OpenMP region (an exception cannot leave one), in
// input order, so the error does not depend on the number of threads.
void raise_first(const std::vector<std::string>& errors) {
  for (const auto& e : errors)
    if (!e.empty()) throw Error(e);
}

// Counts the documents of one input, reading it through (which checks compressed data).
void scan_input(Input& in, ProgressLine& progress) {
  const bool compressed = compression_of(in.path) != Compression::none;
  uint64_t reported = 0;  // bytes of this input added to the progress so far
  if (!in.jsonl && !compressed) {
    // An empty file would still become a document: a dataset of end-of-text tokens alone.
    LOOM_CHECK(in.bytes > 0, "input '", in.path, "' is empty: expected text to tokenize");
    in.documents = 1;
  } else {
    CompressedReader r(in.path);
    const LineCount c = count_lines(r, [&] {
      progress.add_bytes(r.compressed_offset() - reported);
      reported = r.compressed_offset();
    });
    const char* empty = compressed ? "it is empty after decompression" : "it is empty";
    if (in.jsonl) {
      in.documents = c.non_blank;
      LOOM_CHECK(in.documents > 0, "input '", in.path, "' holds no documents (",
                 c.bytes == 0 ? empty : "every line is blank",
                 "): expected one JSON object with a \"text\" field per line");
    } else {
      LOOM_CHECK(c.bytes > 0, "input '", in.path, "' is empty",
                 compressed ? " after decompression" : "", ": expected text to tokenize");
      in.documents = 1;
    }
  }
  if (in.bytes > reported) progress.add_bytes(in.bytes - reported);
  progress.add(in.documents, 0);
}

// A pass over the inputs before any encoding: the doc split must know the number of documents
// before the first is written, and an empty or corrupt input is refused before hours of work.
// Inputs are scanned in parallel: decompression is one thread's work per file, and a dataset is
// often many files.
std::vector<Input> scan_inputs(const std::vector<std::string>& paths, bool tty) {
  std::vector<Input> inputs;
  uint64_t total = 0;
  for (const auto& p : paths) {
    Input in;
    in.path = p;
    const std::string kind = without_compression_suffix(p);
    in.jsonl = fs::path(kind).extension() == ".jsonl";
    std::error_code ec;
    in.bytes = fs::file_size(p, ec);
    LOOM_CHECK(!ec, "cannot read the size of input '", p, "': ", ec.message());
    in.offset = total;
    total += in.bytes;
    inputs.push_back(in);
  }
  ProgressLine progress("reading the inputs", total, tty);
  std::vector<std::string> errors(inputs.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t k = 0; k < inputs.size(); ++k) {
    try {
      scan_input(inputs[k], progress);
    } catch (const std::exception& e) {
      errors[k] = e.what();
    }
  }
  raise_first(errors);
  return inputs;
}

// One document on its way through: raw JSONL line (line > 0) or a whole text file (line == 0).
struct Doc {
  std::string text;
  size_t input = 0;
  int64_t line = 0;
  uint64_t end = 0;  // input bytes read up to its end, over all inputs: the progress it makes
};

// Reads the documents of the inputs in order, a batch at a time, JSONL lines still unparsed.
class BatchReader {
 public:
  explicit BatchReader(const std::vector<Input>& inputs) : inputs_(inputs) {}

  // The next batch into batch; false once every input has been read.
  bool next(std::vector<Doc>& batch) {
    batch.clear();
    uint64_t bytes = 0;
    auto full = [&] { return bytes >= kBatchBytes || batch.size() >= kBatchDocs; };
    while (k_ < inputs_.size() && !full()) {
      const Input& in = inputs_[k_];
      if (!reader_) {
        reader_ = std::make_unique<CompressedReader>(in.path);
        line_ = 0;
      }
      if (!in.jsonl) {
        batch.push_back({reader_->read_all(), k_, 0, in.offset + in.bytes});
        bytes += batch.back().text.size();
        next_input();
        continue;
      }
      std::string line;
      while (!full() && reader_->read_line(line)) {
        ++line_;
        if (is_blank(line)) continue;
        bytes += line.size();
        batch.push_back({std::move(line), k_, line_, in.offset + reader_->compressed_offset()});
      }
      if (!full()) next_input();  // read_line said the input is at its end
    }
    return !batch.empty();
  }

 private:
  void next_input() {
    reader_.reset();
    ++k_;
  }

  const std::vector<Input>& inputs_;
  size_t k_ = 0;  // the input being read
  std::unique_ptr<CompressedReader> reader_;
  int64_t line_ = 0;  // lines of it read so far
};

// A JSONL document's line becomes its "text" in place; returns what is wrong with the line, or
// "" (an exception cannot leave the OpenMP regions this runs in).
std::string parse_document(Doc& d, const std::vector<Input>& inputs) {
  if (d.line == 0) return "";  // a whole text file
  const std::string where = str_cat("input '", inputs[d.input].path, "' line ", d.line, ": ");
  try {
    auto j = nlohmann::json::parse(d.text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return where + "not valid JSON";
    if (!j.is_object()) return where + "not a JSON object (expected {\"text\": \"...\"})";
    const auto it = j.find("text");
    if (it == j.end()) return where + "no \"text\" field (expected {\"text\": \"...\"})";
    if (!it->is_string()) return where + "the \"text\" field is not a string";
    d.text = std::move(it->get_ref<std::string&>());
    return "";
  } catch (const std::exception& e) {
    return where + e.what();
  }
}

// The JSONL lines of a batch parsed in parallel.
void parse_batch(std::vector<Doc>& docs, const std::vector<Input>& inputs) {
  std::vector<std::string> errors(docs.size());
#pragma omp parallel for schedule(dynamic, 64)
  for (size_t i = 0; i < docs.size(); ++i) errors[i] = parse_document(docs[i], inputs);
  raise_first(errors);
}

// Reads the next batch on a thread of its own while the current one is parsed and encoded, so
// that decompressing and splitting lines, which one thread does, overlap the encoders instead of
// holding them up between batches.
class BatchPrefetcher {
 public:
  explicit BatchPrefetcher(const std::vector<Input>& inputs) : reader_(inputs) { start(); }
  ~BatchPrefetcher() {
    if (thread_.joinable()) thread_.join();
  }
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // The next batch into batch; false once every input has been read. A reading error (an input
  // changed since it was scanned) is raised here, in the caller's thread.
  bool next(std::vector<Doc>& batch) {
    thread_.join();
    if (error_) std::rethrow_exception(error_);
    if (!have_) return false;
    batch.swap(ahead_);
    start();
    return true;
  }

 private:
  void start() {
    thread_ = std::thread([this] {
      try {
        have_ = reader_.next(ahead_);
      } catch (...) {
        error_ = std::current_exception();
      }
    });
  }

  BatchReader reader_;
  std::vector<Doc> ahead_;
  bool have_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // the last member: started once the others exist
};

// Calls fn with the documents of all inputs in order, in batches, JSONL lines still unparsed.
void for_each_batch(const std::vector<Input>& inputs,
                    const std::function<void(std::vector<Doc>&)>& fn) {
  BatchPrefetcher reader(inputs);
  std::vector<Doc> batch;
  while (reader.next(batch)) fn(batch);
}

// Cuts the tokens of one split into shards of at most shard_tokens, written into dir (the
// staging directory).
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
  const std::vector<std::string>& names() const { return names_; }  // file names, in order

 private:
  void flush() {
    if (buf_.empty()) return;
    LOOM_CHECK(int(names_.size()) < kMaxShards, "more than ", kMaxShards, " ", split_,
               " shards; raise --shard-tokens");
    char name[64];
    std::snprintf(name, sizeof name, "%s-%05d.bin", split_.c_str(), int(names_.size()));
    write_shard((fs::path(dir_) / name).string(), buf_, vocab_);
    names_.push_back(name);
    buf_.clear();
  }

  std::string dir_, split_;
  uint64_t vocab_, cap_, total_ = 0;
  std::vector<int32_t> buf_;
  std::vector<std::string> names_;
};

// Where this run's shards wait, DIR/.loom-tokenize-<pid>, until every document has been encoded.
// It is removed with whatever is left in it however the run ends, an error included: a run that
// fails half-way leaves no shard of its own, and an earlier run's dataset in DIR stays whole.
class Staging {
 public:
  explicit Staging(const std::string& dir)
      : dir_(dir), path_((fs::path(dir) / (".loom-tokenize-" + std::to_string(::getpid())))) {
    std::error_code ec;
    fs::remove_all(path_, ec);  // left by a killed run that had this pid
    fs::create_directory(path_, ec);
    LOOM_CHECK(!ec, "cannot create the staging directory '", path_.string(), "': ", ec.message());
  }
  ~Staging() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  std::string path() const { return path_.string(); }
  // Moves the staged files to DIR under their names (a rename each: same file system).
  void commit(const std::vector<std::string>& names) const {
    for (const auto& n : names) {
      std::error_code ec;
      fs::rename(path_ / n, dir_ / n, ec);
      LOOM_CHECK(!ec, "cannot move the shard '", (path_ / n).string(), "' to '",
                 (dir_ / n).string(), "': ", ec.message());
    }
  }

 private:
  fs::path dir_, path_;
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
  // A log file or a pipe gets plain progress lines; a terminal one redrawn in place.
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  const DatasetFiles files = expand_dataset_inputs(o.inputs, kInputSuffixes);
  for (const auto& n : files.notes) std::printf("note: %s\n", n.c_str());
  const std::vector<Input> inputs = scan_inputs(files.files, tty);
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
    {
      ProgressLine progress("reading text to train on", input_bytes, tty);
      for_each_batch(inputs, [&](std::vector<Doc>& docs) {
        parse_batch(docs, inputs);
        for (const auto& d : docs) {
          corpus += d.text;
          corpus += '\n';
        }
        progress.add(int64_t(docs.size()), 0);
        progress.bytes_done(docs.back().end);
      });
    }
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
  const Staging staging(o.output);
  SplitWriter train(staging.path(), "train", vocab, o.shard_tokens);
  SplitWriter val(staging.path(), "val", vocab, o.shard_tokens);
  std::vector<int32_t> all;  // the token split must see every token before it can cut
  int64_t doc_index = 0;
  uint64_t text_bytes = 0, total_tokens = 0;
  {
    ProgressLine progress("encoding", input_bytes, tty);
    for_each_batch(inputs, [&](std::vector<Doc>& docs) {
      std::vector<std::vector<int32_t>> ids(docs.size());
      std::vector<std::string> errors(docs.size());
      // Documents are independent, so they are parsed and encoded in parallel, in one region
      // (Tokenizer::encode is const), and kept in input order: the shards are the same whatever
      // the number of threads.
#pragma omp parallel for schedule(dynamic, 1)
      for (size_t i = 0; i < docs.size(); ++i) {
        errors[i] = parse_document(docs[i], inputs);
        if (!errors[i].empty()) continue;
        ids[i] = tok.encode(docs[i].text);
        if (eot >= 0) ids[i].push_back(eot);
        progress.add(1, ids[i].size());
        progress.bytes_done(docs[i].end);
      }
      raise_first(errors);
      for (size_t i = 0; i < docs.size(); ++i, ++doc_index) {
        text_bytes += docs[i].text.size();
        total_tokens += ids[i].size();
        if (!split_by_docs)
          all.insert(all.end(), ids[i].begin(), ids[i].end());
        else
          (doc_index < train_docs ? train : val).add(ids[i].data(), ids[i].size());
      }
    });
  }
  // The scan counted the documents the split went by; an input changed since would shift it.
  LOOM_CHECK(doc_index == num_docs, "the inputs changed while they were read: ", num_docs,
             " documents counted first, ", doc_index, " encoded");
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

  // Every document is in: the shards take their places, and shards of an earlier run beyond this
  // run's count, which would otherwise join the stream, go.
  staging.commit(train.names());
  staging.commit(val.names());
  std::set<std::string> written;
  for (const auto* w : {&train, &val})
    for (const auto& n : w->names()) written.insert((fs::path(o.output) / n).string());
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
  meta["input_files"] = files.files;  // the inputs' directories and patterns expanded, in order
  meta["tokenizer"] = tokenizer_source;
  meta["documents"] = num_docs;
  meta["val_documents"] = split_by_docs ? num_docs - train_docs : 0;
  meta["val_split"] = val.tokens() == 0 ? "none" : split_by_docs ? "documents" : "tokens";
  meta["val_fraction"] = o.val_fraction;
  meta["eot_id"] = eot;
  meta["token_bytes"] = vocab <= 65536 ? 2 : 4;
  meta["shard_tokens"] = o.shard_tokens;
  meta["train_shards"] = train.names();
  meta["val_shards"] = val.names();
  write_text_atomic((fs::path(o.output) / "meta.json").string(), meta.dump(2) + "\n");

  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  std::printf("%lld documents from %zu input file(s), %.2f MB (%.2f MB of text)\n",
              (long long)num_docs, inputs.size(), mb(input_bytes), mb(text_bytes));
  if (o.train_vocab > 0)
    std::printf("trained a vocabulary of %llu ids in %.2f s -> %s\n", (unsigned long long)vocab,
                train_s, o.save_tokenizer.c_str());
  std::printf("%llu tokens (%.2f bytes of text per token), vocab %llu, end-of-text id %d\n",
              (unsigned long long)total_tokens,
              total_tokens ? double(text_bytes) / double(total_tokens) : 0.0,
              (unsigned long long)vocab, eot);
  const double es = std::max(encode_s, 1e-9);
  std::printf("encoded in %.2f s: %.2f MB/s of text, %.0f tokens/s\n", encode_s,
              mb(text_bytes) / es, double(total_tokens) / es);
  std::printf("train: %llu tokens in %zu shard(s); val: %llu tokens in %zu shard(s), split by %s\n",
              (unsigned long long)train.tokens(), train.names().size(),
              (unsigned long long)val.tokens(), val.names().size(),
              split_by_docs ? "documents" : "tokens");
  std::printf("wrote %s (%.2f s in all)\n", o.output.c_str(), total_s);
  return 0;
}

}  // namespace loom
