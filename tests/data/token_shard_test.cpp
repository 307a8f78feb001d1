#include "data/token_shard.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using loom::Shard;
using loom::TokenStream;

namespace {

using loom::test::TempDir;

using loom::test::expect_error;

std::vector<int32_t> random_ids(size_t n, uint64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint64_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = int32_t(d(rng));
  return v;
}

// An independent writer of the format of docs/design.md "The command line", byte by byte, so
// reading is checked against the specification rather than against write_shard.
std::string make_shard_bytes(const char* magic, uint32_t version, uint32_t token_bytes,
                             uint64_t vocab, uint64_t num_tokens,
                             const std::vector<uint32_t>& ids) {
  std::string b(64, '\0');
  std::memcpy(b.data(), magic, 8);
  for (int i = 0; i < 4; ++i) b[8 + i] = char(version >> (8 * i));
  for (int i = 0; i < 4; ++i) b[12 + i] = char(token_bytes >> (8 * i));
  for (int i = 0; i < 8; ++i) b[16 + i] = char(vocab >> (8 * i));
  for (int i = 0; i < 8; ++i) b[24 + i] = char(num_tokens >> (8 * i));
  for (uint32_t id : ids)
    for (uint32_t i = 0; i < token_bytes; ++i) b += char(id >> (8 * i));
  return b;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

uint64_t le(const std::string& b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = v << 8 | uint8_t(b[at + i]);
  return v;
}

}  // namespace

TEST(TokenShard, WritesTheSpecifiedBytesAndReadsThemBack) {
  TempDir dir;
  // 65536 is the largest vocabulary of 2-byte ids, 65537 the smallest of 4-byte ones.
  for (uint64_t vocab : {uint64_t(7), uint64_t(65536), uint64_t(65537), uint64_t(128256)}) {
    const auto ids = random_ids(1001, vocab, uint32_t(vocab));
    const std::string path = dir / loom::str_cat("s", vocab, ".bin");
    loom::write_shard(path, ids, vocab);
    const uint32_t tb = vocab <= 65536 ? 2 : 4;

    const std::string b = read_bytes(path);
    ASSERT_EQ(b.size(), 64 + ids.size() * tb);
    EXPECT_EQ(b.substr(0, 8), "LOOMTOKS");
    EXPECT_EQ(le(b, 8, 4), 1u);
    EXPECT_EQ(le(b, 12, 4), tb);
    EXPECT_EQ(le(b, 16, 8), vocab);
    EXPECT_EQ(le(b, 24, 8), ids.size());
    for (size_t i = 32; i < 64; ++i) EXPECT_EQ(b[i], 0) << i;
    for (size_t i = 0; i < ids.size(); ++i)
      ASSERT_EQ(le(b, 64 + i * tb, int(tb)), uint64_t(ids[i]));

    Shard s(path);
    EXPECT_EQ(s.header().version, 1u);
    EXPECT_EQ(s.header().token_bytes, tb);
    EXPECT_EQ(s.header().vocab_size, vocab);
    EXPECT_EQ(s.size(), ids.size());
    std::vector<int32_t> got(ids.size());
    s.read(0, ids.size(), got.data());
    EXPECT_EQ(got, ids);
    std::vector<int32_t> mid(300);
    s.read(417, 300, mid.data());
    EXPECT_TRUE(std::equal(mid.begin(), mid.end(), ids.begin() + 417));
    EXPECT_EQ(s[1000], ids[1000]);
  }
}

TEST(TokenShard, ReadsShardsOfOtherWriters) {
  TempDir dir;
  // 4-byte ids for a small vocabulary are legal (another tool's choice); so is an empty shard.
  write_bytes(dir / "a.bin", make_shard_bytes("LOOMTOKS", 1, 4, 300, 3, {299, 0, 17}));
  Shard a(dir / "a.bin");
  EXPECT_EQ(a.header().token_bytes, 4u);
  std::vector<int32_t> got(3);
  a.read(0, 3, got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{299, 0, 17}));
  write_bytes(dir / "e.bin", make_shard_bytes("LOOMTOKS", 1, 2, 300, 0, {}));
  EXPECT_EQ(Shard(dir / "e.bin").size(), 0u);
}

TEST(TokenShard, WriteIsAtomicAndRejectsBadIds) {
  TempDir dir;
  const std::string path = dir / "x.bin";
  loom::write_shard(path, std::vector<int32_t>{1, 2, 3}, 10);
  expect_error(
      [&] {
        loom::write_shard(path, std::vector<int32_t>{1, 10, 3}, 10);
      },
      {path, "token 10", "position 1", "[0, 10)"});
  expect_error([&] { loom::write_shard(path, std::vector<int32_t>{-1}, 10); },
               {path, "token -1", "position 0"});
  expect_error([&] { loom::write_shard(path, std::vector<int32_t>{0}, 0); }, {path, "vocab_size"});
  // The failed writes left the old shard whole and no temporary file behind.
  Shard s(path);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[1], 2);
  loom::write_shard(path, std::vector<int32_t>{4, 5}, 10);  // overwrite
  EXPECT_EQ(Shard(path).size(), 2u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  expect_error([&] { loom::write_shard(dir / "no/such/dir/y.bin", std::vector<int32_t>{1}, 10); },
               {"no/such/dir/y.bin", "cannot create"});
}

TEST(TokenShard, ValidationErrorsNameTheFileAndTheProblem) {
  TempDir dir;
  const std::vector<uint32_t> ids = {1, 2, 3, 4};
  auto check = [&](const std::string& name, const std::string& bytes,
                   const std::vector<std::string>& parts) {
    const std::string path = dir / name;
    write_bytes(path, bytes);
    std::vector<std::string> all = parts;
    all.push_back(path);
    expect_error([&] { Shard s(path); }, all);
  };
  check("magic.bin", make_shard_bytes("LOOMTOKZ", 1, 2, 10, 4, ids), {"bad magic", "LOOMTOKZ"});
  check("version.bin", make_shard_bytes("LOOMTOKS", 2, 2, 10, 4, ids), {"version 2", "expected 1"});
  check("tb.bin", make_shard_bytes("LOOMTOKS", 1, 3, 10, 4, ids), {"token_bytes 3", "2 or 4"});
  check("tb2.bin", make_shard_bytes("LOOMTOKS", 1, 2, 70000, 4, ids), {"token_bytes 2", "70000"});
  check("vocab0.bin", make_shard_bytes("LOOMTOKS", 1, 2, 0, 4, ids), {"vocab_size 0"});
  check("header.bin", make_shard_bytes("LOOMTOKS", 1, 2, 10, 4, ids).substr(0, 40),
        {"truncated", "40 bytes"});
  check("short.bin", make_shard_bytes("LOOMTOKS", 1, 2, 10, 5, ids), {"truncated", "5 tokens"});
  check("huge.bin", make_shard_bytes("LOOMTOKS", 1, 4, 10, uint64_t(1) << 62, ids), {"truncated"});
  check("long.bin", make_shard_bytes("LOOMTOKS", 1, 2, 10, 3, ids), {"72 bytes", "implies 70"});
  std::string reserved = make_shard_bytes("LOOMTOKS", 1, 2, 10, 4, ids);
  reserved[50] = 1;
  check("reserved.bin", reserved, {"reserved", "byte 50"});
  expect_error([&] { Shard s(dir / "missing.bin"); }, {dir / "missing.bin", "cannot open"});
}

// Ids are validated once when a shard is opened, so a bad id deep in a dataset stops the run at
// its start rather than when training reaches it.
TEST(TokenShard, IdOutsideTheVocabularyIsFoundAtOpen) {
  TempDir dir;
  const std::string path = dir / "bad.bin";
  write_bytes(path, make_shard_bytes("LOOMTOKS", 1, 2, 10, 6, {1, 2, 3, 4, 12, 5}));
  expect_error([&] { Shard s(path); }, {path, "token 12", "position 4", "10"});
  // 4-byte ids with the top bit set are not negative ids but out-of-range ones.
  write_bytes(dir / "neg.bin", make_shard_bytes("LOOMTOKS", 1, 4, 70000, 2, {5, 0x80000001u}));
  expect_error([&] { Shard n(dir / "neg.bin"); }, {"neg.bin", "position 1", "2147483649"});
  // Far into a shard of several scan chunks, with 4-byte ids: the exact position is named.
  std::vector<int32_t> ids(3000000, 7);
  const std::string big = dir / "big.bin";
  loom::write_shard(big, ids, 70000);
  {
    Shard ok(big);
    EXPECT_EQ(ok.size(), ids.size());
  }
  {
    std::fstream f(big, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 4 * 2500001);
    const uint32_t bad = 70000;
    f.write(reinterpret_cast<const char*>(&bad), 4);
  }
  expect_error([&] { Shard b(big); }, {big, "token 70000", "position 2500001", "70000"});
  // A dataset directory with such a shard fails when it is opened, naming the file.
  fs::create_directories(dir.path() / "ds");
  fs::copy_file(big, dir / "ds/train-00000.bin");
  expect_error([&] { TokenStream t(dir / "ds", "train"); },
               {"train-00000.bin", "position 2500001"});
}

TEST(TokenStream, ConcatenatesShardsInNameOrderAndWraps) {
  TempDir dir;
  const auto a = random_ids(37, 50, 1), b = random_ids(5, 50, 2), c = random_ids(64, 50, 3);
  // Written out of order; an empty shard, other splits and other files are in the directory too.
  loom::write_shard(dir / "train-00002.bin", c, 50);
  loom::write_shard(dir / "train-00000.bin", a, 50);
  loom::write_shard(dir / "train-00001.bin", b, 50);
  loom::write_shard(dir / "train-00001a.bin", std::vector<int32_t>{}, 50);
  loom::write_shard(dir / "val-00000.bin", std::vector<int32_t>{7, 7}, 50);
  write_bytes(dir / "train-notes.txt", "not a shard");
  TokenStream s(dir.path().string(), "train");
  ASSERT_EQ(s.files().size(), 4u);
  EXPECT_EQ(fs::path(s.files()[0]).filename(), "train-00000.bin");
  EXPECT_EQ(fs::path(s.files()[3]).filename(), "train-00002.bin");
  EXPECT_EQ(s.vocab_size(), 50u);
  std::vector<int32_t> all = a;
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  ASSERT_EQ(s.size(), all.size());
  // Every (begin, n) across shard boundaries, past the end (wrapping) and longer than the stream.
  const uint64_t N = all.size();
  std::vector<int32_t> out(3 * N);
  for (uint64_t begin : {uint64_t(0), uint64_t(30), uint64_t(36), uint64_t(37), uint64_t(41),
                         uint64_t(42), N - 1, N, 5 * N + 3}) {
    for (uint64_t n : {uint64_t(1), uint64_t(7), uint64_t(70), N, 2 * N + 5}) {
      s.read(begin, n, out.data());
      for (uint64_t i = 0; i < n; ++i)
        ASSERT_EQ(out[i], all[(begin + i) % N]) << "begin " << begin << " n " << n << " i " << i;
    }
  }
  TokenStream v(dir.path().string(), "val");
  EXPECT_EQ(v.size(), 2u);
}

TEST(TokenStream, ErrorsNameTheDirectoryAndTheProblem) {
  TempDir dir;
  const std::string d = dir.path().string();
  expect_error([&] { TokenStream s(d, "train"); }, {d, "train-*.bin", "no token shards"});
  EXPECT_TRUE(TokenStream::find_files(d, "train").empty());
  expect_error([&] { TokenStream s(d + "/nope", "train"); }, {d + "/nope", "not a directory"});
  loom::write_shard(dir / "train-00000.bin", std::vector<int32_t>{1, 2}, 100);
  loom::write_shard(dir / "train-00001.bin", std::vector<int32_t>{3}, 200);
  expect_error([&] { TokenStream s(d, "train"); },
               {"vocab_size", "train-00000.bin' has 100", "train-00001.bin' has 200"});
  loom::write_shard(dir / "val-00000.bin", std::vector<int32_t>{}, 100);
  expect_error([&] { TokenStream s(d, "val"); }, {"hold no tokens", d});
}
