#include "data/compressed_reader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"

namespace fs = std::filesystem;
using loom::CompressedReader;
using loom::Compression;

namespace {

using loom::test::TempDir;

// One gzip member (header, deflate data, CRC-32 and length), as `gzip -c` writes.
std::string gzip(const std::string& text) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, uLong(text.size())) + 32, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  zs.avail_in = uInt(text.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = uInt(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// One zstd frame with its content checksum, as the `zstd` command writes.
std::string zstd(const std::string& text) {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1);
  std::string out(ZSTD_compressBound(text.size()), '\0');
  const size_t n = ZSTD_compress2(c, out.data(), out.size(), text.data(), text.size());
  ZSTD_freeCCtx(c);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// Lines of every length up to a few MB: more than the reader's buffers, so lines span refills.
std::string make_text() {
  std::string s;
  uint32_t r = 7;
  for (int i = 0; i < 3000; ++i) {
    r = r * 1103515245u + 12345u;
    const size_t len = i == 1500 ? (size_t(3) << 20) : (r >> 16) % 2000;
    for (size_t k = 0; k < len; ++k) s += char('a' + (k * 31 + size_t(i)) % 26);
    s += i % 7 == 0 ? "\r\n" : "\n";
    if (i % 100 == 0) s += "\n";  // empty lines are lines too
  }
  s += "a last line without a newline";
  return s;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  size_t p = 0;
  while (p < s.size()) {
    const size_t nl = s.find('\n', p);
    if (nl == std::string::npos) {
      lines.push_back(s.substr(p));
      break;
    }
    lines.push_back(s.substr(p, nl - p));
    p = nl + 1;
  }
  return lines;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(CompressedReader, NamesSayTheCompression) {
  EXPECT_EQ(loom::compression_of("a/x.jsonl.gz"), Compression::gzip);
  EXPECT_EQ(loom::compression_of("x.txt.zst"), Compression::zstd);
  EXPECT_EQ(loom::compression_of("x.jsonl"), Compression::none);
  EXPECT_EQ(loom::without_compression_suffix("a/x.jsonl.gz"), "a/x.jsonl");
  EXPECT_EQ(loom::without_compression_suffix("x.txt.zst"), "x.txt");
  EXPECT_EQ(loom::without_compression_suffix("x.txt"), "x.txt");
}

TEST(CompressedReader, ReadsLinesAndAllOfEveryKind) {
  TempDir dir;
  const std::string text = make_text();
  const auto lines = split_lines(text);
  for (const auto& [name, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"x.txt", text}, {"x.txt.gz", gzip(text)}, {"x.txt.zst", zstd(text)}}) {
    SCOPED_TRACE(name);
    const std::string path = dir.write(name, bytes);
    {
      CompressedReader r(path);
      EXPECT_EQ(r.file_bytes(), bytes.size());
      std::vector<std::string> got;
      std::string line;
      while (r.read_line(line)) got.push_back(line);
      EXPECT_EQ(got, lines);
      EXPECT_EQ(r.compressed_offset(), bytes.size());
      EXPECT_FALSE(r.read_line(line));
    }
    CompressedReader r(path);
    EXPECT_EQ(r.read_all(), text);
  }
}

// `cat a.gz b.gz` is a valid gzip file of both texts, and so are concatenated zstd frames.
TEST(CompressedReader, ReadsConcatenatedMembersAndFrames) {
  TempDir dir;
  const std::string a = "first part\nsecond line\n", b = "third line\nfourth";
  EXPECT_EQ(CompressedReader(dir.write("x.gz", gzip(a) + gzip(b))).read_all(), a + b);
  EXPECT_EQ(CompressedReader(dir.write("x.zst", zstd(a) + zstd(b))).read_all(), a + b);
  EXPECT_EQ(CompressedReader(dir.write("e.gz", gzip(""))).read_all(), "");
}

TEST(CompressedReader, CorruptDataIsAnErrorNamingTheFileAndTheOffset) {
  TempDir dir;
  const std::string text = make_text();
  const std::string gz = gzip(text), zs = zstd(text);

  const std::string truncated_gz = dir.write("t.txt.gz", gz.substr(0, gz.size() / 2));
  std::string e = error_of([&] { CompressedReader(truncated_gz).read_all(); });
  EXPECT_NE(e.find("'" + truncated_gz + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("ends inside a gzip member"), std::string::npos) << e;
  EXPECT_NE(e.find(loom::str_cat("compressed byte ", gz.size() / 2)), std::string::npos) << e;

  std::string bad_crc = gz;
  bad_crc[bad_crc.size() - 8] ^= 1;  // the trailer: CRC-32, then the length
  const std::string crc_gz = dir.write("c.txt.gz", bad_crc);
  e = error_of([&] {
    CompressedReader r(crc_gz);
    std::string line;
    while (r.read_line(line)) {
    }
  });
  EXPECT_NE(e.find("incorrect data check"), std::string::npos) << e;
  EXPECT_NE(e.find("compressed byte"), std::string::npos) << e;

  const std::string truncated_zst = dir.write("t.txt.zst", zs.substr(0, zs.size() - 3));
  e = error_of([&] { CompressedReader(truncated_zst).read_all(); });
  EXPECT_NE(e.find("'" + truncated_zst + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("ends inside a zstd frame"), std::string::npos) << e;

  std::string bad_sum = zs;
  bad_sum[bad_sum.size() - 1] ^= 1;  // the frame's last 4 bytes: its content checksum
  const std::string sum_zst = dir.write("c.txt.zst", bad_sum);
  e = error_of([&] { CompressedReader(sum_zst).read_all(); });
  EXPECT_NE(e.find("checksum"), std::string::npos) << e;
  EXPECT_NE(e.find(loom::str_cat("found between compressed bytes ")), std::string::npos) << e;
  EXPECT_NE(e.find(loom::str_cat(" and ", zs.size(), " of ", zs.size())), std::string::npos) << e;

  // Not compressed at all, though the name says so.
  const std::string plain_gz = dir.write("p.txt.gz", "plain text\n");
  e = error_of([&] { CompressedReader(plain_gz).read_all(); });
  EXPECT_NE(e.find("not valid gzip data"), std::string::npos) << e;

  e = error_of([&] { CompressedReader((dir.path() / "nope.gz").string()); });
  EXPECT_NE(e.find("cannot open input"), std::string::npos) << e;
}
