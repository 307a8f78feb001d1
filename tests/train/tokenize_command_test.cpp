// `loom tokenize` end to end: runs the built `loom` binary (LOOM_BIN, set by ctest, or the `loom`
// beside this test binary) and checks its shards against the Tokenizer library directly.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "data/token_shard.hpp"
#include "data/tokenizer.hpp"

namespace fs = std::filesystem;
using loom::Tokenizer;
using loom::TokenStream;

namespace {

std::string loom_bin() {
  if (const char* b = std::getenv("LOOM_BIN"); b && *b) return b;
  std::error_code ec;
  return (fs::read_symlink("/proc/self/exe", ec).parent_path() / "loom").string();
}

struct RunResult {
  int rc = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

struct TokenizeTest : ::testing::Test {
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() /
          loom::str_cat("loom_tokenize_test_", ::getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    ASSERT_TRUE(fs::exists(loom_bin()))
        << "the loom binary '" << loom_bin() << "' does not exist (build it, or set LOOM_BIN)";
  }
  void TearDown() override { fs::remove_all(dir); }

  std::string path(const std::string& name) const { return (dir / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream f(dir / name, std::ios::binary);
    f << text;
    return path(name);
  }
  // env: assignments put before the command ("OMP_NUM_THREADS=1").
  RunResult tokenize(const std::vector<std::string>& args, const std::string& env = "") const {
    std::string cmd = loom::str_cat(env, " '", loom_bin(), "' tokenize");
    for (const auto& a : args) cmd += loom::str_cat(" '", a, "'");
    cmd += loom::str_cat(" > '", path("stdout"), "' 2> '", path("stderr"), "'");
    RunResult r;
    const int st = std::system(cmd.c_str());
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(dir / "stdout");
    r.err = slurp(dir / "stderr");
    return r;
  }
  void expect_failure(const std::vector<std::string>& args, const std::vector<std::string>& parts) {
    const RunResult r = tokenize(args);
    EXPECT_NE(r.rc, 0) << r.out;
    for (const auto& p : parts)
      EXPECT_NE(r.err.find(p), std::string::npos) << "'" << p << "' not in: " << r.err;
  }
};

// The shards of an output directory, file name -> bytes.
std::map<std::string, std::string> shards_of(const std::string& dir) {
  std::map<std::string, std::string> m;
  for (const std::string split : {"train", "val"})
    for (const auto& f : TokenStream::find_files(dir, split))
      m[fs::path(f).filename().string()] = slurp(f);
  return m;
}

// Runs a shell command (compressing a test file with gzip or zstd, as people make them).
void shell(const std::string& cmd) {
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << cmd << " failed (gzip and zstd come with scripts/deps.sh)";
}

// What is in an output directory after a failed run: none of train-*.bin, val-*.bin, meta.json
// or the staging directory may be there.
std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) found.push_back(e.path().filename());
  std::sort(found.begin(), found.end());
  return found;
}

std::vector<int32_t> read_split(const std::string& dir, const std::string& split) {
  TokenStream s(dir, split);
  std::vector<int32_t> v(s.size());
  s.read(0, s.size(), v.data());
  return v;
}

// Documents with some variety: punctuation, quotes, newlines, multi-byte UTF-8.
std::vector<std::string> make_documents(int n) {
  const char* words[] = {"the",   "loom",  "weaves", "a",     "thread", "of",    "tokens",
                         "and",   "every", "shard",  "holds", "ids",    "café",  "naïve",
                         "\"q\"", "x=1;",  "日本",   "\n",    "  ",     "don't", "42"};
  std::vector<std::string> docs;
  uint32_t r = 12345;
  for (int d = 0; d < n; ++d) {
    std::string s;
    const int len = 20 + d * 7 % 40;
    for (int w = 0; w < len; ++w) {
      r = r * 1103515245u + 12345u;
      s += words[(r >> 16) % (sizeof words / sizeof *words)];
      s += (r >> 8) % 5 ? " " : ". ";
    }
    docs.push_back(s);
  }
  return docs;
}

std::vector<int32_t> encode_documents(const Tokenizer& tok, const std::vector<std::string>& docs) {
  std::vector<int32_t> ids;
  for (const auto& d : docs) {
    const auto e = tok.encode(d);
    ids.insert(ids.end(), e.begin(), e.end());
    ids.push_back(tok.eot_id());
  }
  return ids;
}

}  // namespace

TEST_F(TokenizeTest, TrainsAVocabularyAndSplitsByDocuments) {
  const auto docs = make_documents(11);
  // Ten JSONL documents (a blank line among them, which is no document) and one text file.
  std::string jsonl;
  for (int i = 0; i < 10; ++i) {
    jsonl += nlohmann::json{{"id", i}, {"text", docs[size_t(i)]}}.dump() + "\n";
    if (i == 4) jsonl += "   \n";
  }
  const std::string a = write("a.jsonl", jsonl), b = write("b.txt", docs[10]);
  const std::string out = path("out"), tok_path = path("tok.json");
  const RunResult r = tokenize({"--input", a, b, "--output", out, "--train-vocab", "300",
                                "--save-tokenizer", tok_path, "--val-fraction", "0.2"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("11 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("MB/s"), std::string::npos) << r.out;

  const Tokenizer tok = Tokenizer::load(tok_path);
  ASSERT_GE(tok.eot_id(), 0);
  EXPECT_LE(tok.vocab_size(), 300);
  // round(0.2 * 11) = 2 documents in val, 9 in train: whole documents, split between them.
  const std::vector<std::string> train_docs(docs.begin(), docs.begin() + 9),
      val_docs(docs.begin() + 9, docs.end());
  const auto train = read_split(out, "train"), val = read_split(out, "val");
  EXPECT_EQ(train, encode_documents(tok, train_docs));
  EXPECT_EQ(val, encode_documents(tok, val_docs));
  EXPECT_EQ(TokenStream(out, "train").vocab_size(), uint64_t(tok.vocab_size()));

  // The shards decode back to the documents, one per end-of-text id.
  std::vector<int32_t> all = train;
  all.insert(all.end(), val.begin(), val.end());
  std::vector<std::string> decoded;
  std::vector<int32_t> piece;
  for (int32_t id : all) {
    if (id == tok.eot_id()) {
      decoded.push_back(tok.decode(piece));
      piece.clear();
    } else {
      piece.push_back(id);
    }
  }
  EXPECT_TRUE(piece.empty());
  EXPECT_EQ(decoded, docs);

  // The copy of the tokenizer beside the shards encodes the same way.
  const Tokenizer copy = Tokenizer::load(out + "/tokenizer.json");
  EXPECT_EQ(copy.vocab_size(), tok.vocab_size());
  EXPECT_EQ(copy.encode(docs[3]), tok.encode(docs[3]));

  const auto meta = nlohmann::json::parse(slurp(out + "/meta.json"));
  EXPECT_EQ(meta["vocab_size"].get<int64_t>(), tok.vocab_size());
  EXPECT_EQ(meta["train_tokens"].get<size_t>(), train.size());
  EXPECT_EQ(meta["val_tokens"].get<size_t>(), val.size());
  EXPECT_EQ(meta["inputs"], nlohmann::json({a, b}));
  EXPECT_EQ(meta["tokenizer"].get<std::string>(), tok_path);
  EXPECT_EQ(meta["val_split"].get<std::string>(), "documents");
}

TEST_F(TokenizeTest, OneTextSplitsByTokensIntoShards) {
  std::string text;
  for (const auto& d : make_documents(20)) text += d + "\n";
  const Tokenizer trained = Tokenizer::train(text, 280);
  const std::string tok_path = path("tok.json");
  trained.save(tok_path);
  const std::string in = write("bible.txt", text), out = path("out");
  fs::create_directories(out);
  loom::write_shard(out + "/train-00099.bin", std::vector<int32_t>{1, 2, 3}, 280);  // stale

  const RunResult r = tokenize({loom::str_cat("--input=", in), "--output", out, "--tokenizer",
                                tok_path, "--val-fraction=0.1", "--shard-tokens", "100"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const Tokenizer tok = Tokenizer::load(tok_path);
  const std::vector<int32_t> expected = encode_documents(tok, {text});
  const size_t n_val = size_t(std::llround(0.1 * double(expected.size())));
  ASSERT_GT(n_val, 100u) << "the text is too short to make several val shards";

  // Shards of at most 100 tokens, all full but the last of each split, in name order.
  for (const std::string split : {"train", "val"}) {
    const auto files = TokenStream::find_files(out, split);
    const size_t n = split == "train" ? expected.size() - n_val : n_val;
    ASSERT_EQ(files.size(), (n + 99) / 100) << split;
    for (size_t k = 0; k < files.size(); ++k) {
      char name[32];
      std::snprintf(name, sizeof name, "%s-%05zu.bin", split.c_str(), k);
      EXPECT_EQ(fs::path(files[k]).filename(), name);
      EXPECT_EQ(loom::Shard(files[k]).size(), k + 1 < files.size() ? 100u : n - 100 * k);
    }
  }
  EXPECT_FALSE(fs::exists(out + "/train-00099.bin")) << "a stale shard of an earlier run is left";
  const auto train = read_split(out, "train"), val = read_split(out, "val");
  EXPECT_EQ(val.size(), n_val);
  std::vector<int32_t> all = train;
  all.insert(all.end(), val.begin(), val.end());
  EXPECT_EQ(all, expected);
  all.pop_back();  // the end-of-text id
  EXPECT_EQ(tok.decode(all), text);
  const auto meta = nlohmann::json::parse(slurp(out + "/meta.json"));
  EXPECT_EQ(meta["val_split"].get<std::string>(), "tokens");
  EXPECT_EQ(meta["val_tokens"].get<size_t>(), n_val);
}

TEST_F(TokenizeTest, ErrorsSayWhatIsWrong) {
  const std::string tok_path = path("tok.json");
  Tokenizer::train("some text to learn from, some text", 260).save(tok_path);
  const std::string good = write("good.txt", "hello"), out = path("out");
  expect_failure({"--input", path("nope.txt"), "--output", out, "--tokenizer", tok_path},
                 {"nope.txt", "does not exist"});
  const std::string bad = write("bad.jsonl", "{\"text\": \"a\"}\n\n{\"txt\": \"b\"}\n");
  expect_failure({"--input", bad, "--output", out, "--tokenizer", tok_path},
                 {"bad.jsonl' line 3", "no \"text\" field"});
  expect_failure({"--input", bad, "--output", out, "--train-vocab", "260", "--save-tokenizer",
                  path("t2.json")},
                 {"bad.jsonl' line 3", "\"text\""});
  const std::string broken = write("broken.jsonl", "{\"text\": \"a\"}\n{\"text\": \n");
  expect_failure({"--input", broken, "--output", out, "--tokenizer", tok_path},
                 {"broken.jsonl' line 2", "not valid JSON"});
  const std::string number = write("number.jsonl", "{\"text\": 5}\n");
  expect_failure({"--input", number, "--output", out, "--tokenizer", tok_path},
                 {"number.jsonl' line 1", "not a string"});
  // Empty input: no dataset of end-of-text tokens alone, and no shard written.
  const std::string empty = write("empty.txt", "");
  expect_failure({"--input", good, empty, "--output", out, "--tokenizer", tok_path},
                 {"empty.txt' is empty"});
  const std::string empty_jsonl = write("empty.jsonl", "");
  expect_failure({"--input", empty_jsonl, "--output", out, "--tokenizer", tok_path},
                 {"empty.jsonl' holds no documents", "it is empty"});
  const std::string blank_jsonl = write("blank.jsonl", "\n  \n");
  expect_failure({"--input", blank_jsonl, "--output", out, "--train-vocab", "260",
                  "--save-tokenizer", path("t3.json")},
                 {"blank.jsonl' holds no documents", "every line is blank"});
  // Under a regular file no directory can be made, whoever runs the test (even root).
  expect_failure({"--input", good, "--output", good + "/sub", "--tokenizer", tok_path},
                 {"cannot create the output directory", good + "/sub"});
  expect_failure({"--input", good, "--output", good, "--tokenizer", tok_path},
                 {good, "not a directory"});
  expect_failure({"--input", good, "--output", out}, {"no tokenizer", "--train-vocab"});
  expect_failure({"--input", good, "--output", out, "--train-vocab", "300"}, {"--save-tokenizer"});
  expect_failure({"--input", good, "--output", out, "--tokenizer", tok_path, "--train-vocab", "3"},
                 {"not both"});
  expect_failure({"--output", out, "--tokenizer", tok_path}, {"--input"});
  expect_failure({"--input", good, "--tokenizer", tok_path}, {"--output"});
  expect_failure(
      {"--input", good, "--output", out, "--tokenizer", tok_path, "--val-fraction", "1.5"},
      {"--val-fraction", "1.5"});
  expect_failure({"--input", good, "--output", out, "--tokenizer", tok_path, "--shard-tokens", "0"},
                 {"--shard-tokens", "positive integer"});
  expect_failure({"--input", good, "--output", out, "--tokenizer", tok_path, "--frobnicate"},
                 {"unknown argument '--frobnicate'"});
  EXPECT_FALSE(fs::exists(out + "/meta.json"));
}

// A rank file loom does not recognise needs --split-pattern (it holds no pattern of its own).
TEST_F(TokenizeTest, UnknownRankFileNeedsASplitPattern) {
  std::string ranks;
  const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int b = 0; b < 256; ++b)  // one-byte tokens: base64 of byte b is 2 chars + "=="
    ranks += loom::str_cat(b64[b >> 2], b64[(b & 3) << 4], "== ", b, "\n");
  const std::string tik = write("mine.tiktoken", ranks);
  const std::string good = write("good.txt", "hello world"), out = path("out");
  expect_failure({"--input", good, "--output", out, "--tokenizer", tik},
                 {"mine.tiktoken", "does not recognise", "--split-pattern"});
  const RunResult r =
      tokenize({"--input", good, "--output", out, "--tokenizer", tik, "--split-pattern", "gpt2"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(read_split(out, "train").size(), 11u);  // one token per byte
}

// Many JSONL documents: enough for several batches of the threads, and for a compressed file of
// some kilobytes (so a truncation or a flipped byte lands inside the data).
std::string make_jsonl(int n) {
  std::string jsonl;
  int i = 0;
  for (const auto& d : make_documents(n))
    jsonl += nlohmann::json{{"id", i++}, {"text", d}}.dump() + "\n";
  return jsonl;
}

TEST_F(TokenizeTest, CompressedInputsGiveTheSameShards) {
  const std::string tok_path = path("tok.json");
  Tokenizer::train(make_jsonl(50), 300).save(tok_path);
  const std::string plain = write("x.jsonl", make_jsonl(400));
  const std::string text = write("y.txt", make_documents(3)[2]);
  shell(
      loom::str_cat("gzip -k '", plain, "' '", text, "' && zstd -q -k '", plain, "' '", text, "'"));
  std::map<std::string, std::string> expected;
  for (const std::string suffix : {"", ".gz", ".zst"}) {
    SCOPED_TRACE(suffix);
    const std::string out = path("out" + suffix);
    const RunResult r =
        tokenize({"--input", plain + suffix, text + suffix, "--output", out, "--tokenizer",
                  tok_path, "--val-fraction", "0.1", "--shard-tokens", "2000"});
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.out.find("401 documents"), std::string::npos) << r.out;
    const auto shards = shards_of(out);
    EXPECT_GT(shards.size(), 2u);
    if (suffix[0] == '\0')
      expected = shards;
    else
      EXPECT_TRUE(shards == expected) << "the shards of the " << suffix << " inputs differ";
  }
  // Empty once decompressed: refused as the plain empty files are.
  shell(loom::str_cat("printf '' | gzip > '", path("e.jsonl.gz"), "' && printf '' | zstd -q > '",
                      path("e.txt.zst"), "'"));
  expect_failure({"--input", path("e.jsonl.gz"), "--output", path("o"), "--tokenizer", tok_path},
                 {"e.jsonl.gz' holds no documents", "empty after decompression"});
  expect_failure({"--input", path("e.txt.zst"), "--output", path("o"), "--tokenizer", tok_path},
                 {"e.txt.zst' is empty after decompression"});
}

TEST_F(TokenizeTest, DirectoriesAndGlobsGiveTheSameShardsAsTheFiles) {
  const std::string tok_path = path("tok.json");
  Tokenizer::train(make_jsonl(50), 300).save(tok_path);
  fs::create_directories(dir / "d/b/c");
  fs::create_directories(dir / "d/a");
  fs::create_directories(dir / "d/.git");
  write("d/b/2.jsonl", make_jsonl(30));
  write("d/b/c/3.txt", make_documents(7)[6]);
  write("d/a/1.jsonl", make_jsonl(20));
  write("d/a/4.jsonl", make_jsonl(10));
  shell(loom::str_cat("gzip '", path("d/a/4.jsonl"), "' && zstd -q --rm '", path("d/b/2.jsonl"),
                      "'"));
  write("d/README.md", "not a document");       // no known suffix: skipped, with a note
  write("d/.hidden.jsonl", "{\"text\": 1}\n");  // hidden, as from a shell's *: skipped
  write("d/.git/x.txt", "skipped");
  // Sorted by path: d/a/1.jsonl < d/a/4.jsonl.gz < d/b/2.jsonl.zst < d/b/c/3.txt.
  const std::vector<std::string> files = {path("d/a/1.jsonl"), path("d/a/4.jsonl.gz"),
                                          path("d/b/2.jsonl.zst"), path("d/b/c/3.txt")};
  std::vector<std::string> args = {"--output",       path("files"),    "--tokenizer",
                                   tok_path,         "--val-fraction", "0.2",
                                   "--shard-tokens", "1500",           "--input"};
  args.insert(args.end(), files.begin(), files.end());
  RunResult r = tokenize(args);
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto expected = shards_of(path("files"));
  ASSERT_GT(expected.size(), 2u);

  r = tokenize({"--input", path("d"), "--output", path("dir"), "--tokenizer", tok_path,
                "--val-fraction", "0.2", "--shard-tokens", "1500"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(shards_of(path("dir")) == expected) << "a directory input gives other shards";
  EXPECT_NE(r.out.find("1 file(s) not ending in .txt or .jsonl"), std::string::npos) << r.out;
  const auto meta = nlohmann::json::parse(slurp(path("dir/meta.json")));
  EXPECT_EQ(meta["input_files"], nlohmann::json(files));
  EXPECT_EQ(meta["inputs"], nlohmann::json({path("d")}));

  // A pattern the shell did not expand (quoted); a matching directory is walked too.
  r = tokenize({"--input", path("d/a/*"), path("d/[b]"), "--output", path("glob"), "--tokenizer",
                tok_path, "--val-fraction", "0.2", "--shard-tokens", "1500"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(shards_of(path("glob")) == expected) << "a glob input gives other shards";

  expect_failure({"--input", path("d/*.parquet"), "--output", path("o"), "--tokenizer", tok_path},
                 {"d/*.parquet' matches no file"});
  fs::create_directories(dir / "empty/sub");
  write("empty/notes.md", "x");
  expect_failure(
      {"--input", path("empty"), "--output", path("o"), "--tokenizer", tok_path},
      {"input directory '" + path("empty") + "' holds no file ending in .txt or .jsonl"});
}

// A corrupt compressed input is refused naming the file and the compressed byte offset, and a run
// that fails half-way leaves no shard, meta.json or staging directory of its own, and an earlier
// run's dataset as it was.
TEST_F(TokenizeTest, CorruptInputsLeaveNoShards) {
  const std::string tok_path = path("tok.json");
  Tokenizer::train(make_jsonl(50), 300).save(tok_path);
  const std::string good = write("good.jsonl", make_jsonl(2000));
  shell(loom::str_cat("gzip -k '", good, "' && zstd -q -k '", good, "'"));
  const std::string gz = slurp(good + ".gz"), zst = slurp(good + ".zst");
  ASSERT_GT(zst.size(), 1000u);
  write("truncated.jsonl.gz", gz.substr(0, gz.size() / 2));
  std::string flipped = zst;
  flipped[flipped.size() / 2] ^= 0x40;
  write("flipped.jsonl.zst", flipped);

  // An earlier run's dataset in the output directory.
  const std::string out = path("out");
  RunResult r = tokenize({"--input", good, "--output", out, "--tokenizer", tok_path,
                          "--val-fraction", "0.1", "--shard-tokens", "3000"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto before = leftovers(out);
  const auto shards_before = shards_of(out);
  const std::string meta_before = slurp(out + "/meta.json");

  const std::string fresh = path("fresh");
  for (const std::string& o : {fresh, out}) {
    expect_failure({"--input", good, path("truncated.jsonl.gz"), "--output", o, "--tokenizer",
                    tok_path, "--shard-tokens", "3000"},
                   {"truncated.jsonl.gz' is not valid gzip data", "ends inside a gzip member",
                    loom::str_cat("compressed byte ", gz.size() / 2)});
    expect_failure({"--input", good, path("flipped.jsonl.zst"), "--output", o, "--tokenizer",
                    tok_path, "--shard-tokens", "3000"},
                   {"flipped.jsonl.zst' is not valid zstd data", "compressed byte"});
  }
  // Those were found before any encoding. A bad JSON line after the first batch of documents
  // (16384) is found only once that batch is in shards of 3000 tokens: they must not stay.
  std::string jsonl;
  for (int i = 0; i < 17000; ++i) jsonl += loom::str_cat("{\"text\": \"doc ", i, "\"}\n");
  jsonl += "{\"text\": \"the last\"\n";
  const std::string late = write("late.jsonl", jsonl);
  for (const std::string& o : {fresh, out})
    expect_failure(
        {"--input", late, "--output", o, "--tokenizer", tok_path, "--shard-tokens", "3000"},
        {"late.jsonl' line 17001", "not valid JSON"});
  EXPECT_EQ(leftovers(fresh), std::vector<std::string>{}) << "a failed run left files";
  EXPECT_EQ(leftovers(out), before) << "a failed run changed an earlier run's files";
  EXPECT_TRUE(shards_of(out) == shards_before) << "a failed run changed an earlier run's shards";
  EXPECT_EQ(slurp(out + "/meta.json"), meta_before);
}

// Documents are encoded by every thread, and the output must not depend on how many there are;
// --train-vocab makes the tokenizer part of what must be the same.
TEST_F(TokenizeTest, SameOutputWithOneAndTwoThreads) {
  const std::string in = write("x.jsonl", make_jsonl(3000));
  std::map<std::string, std::string> first;
  std::string first_tok;
  for (const int threads : {1, 2}) {
    const std::string out = path(loom::str_cat("out", threads));
    const RunResult r =
        tokenize({"--input", in, "--output", out, "--train-vocab", "400", "--save-tokenizer",
                  out + ".tok.json", "--val-fraction", "0.05", "--shard-tokens", "20000"},
                 loom::str_cat("OMP_NUM_THREADS=", threads));
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto shards = shards_of(out);
    EXPECT_GT(shards.size(), 2u);
    if (threads == 1) {
      first = shards;
      first_tok = slurp(out + "/tokenizer.json");
    } else {
      EXPECT_TRUE(shards == first) << "2 threads wrote other shards than 1";
      EXPECT_EQ(slurp(out + "/tokenizer.json"), first_tok);
    }
  }
}
