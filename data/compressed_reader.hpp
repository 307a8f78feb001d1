#pragma once
// Reads a file of text that may be compressed, as a stream: gzip when its name ends in ".gz"
// (concatenated members too, as `gzip -d` reads them), Zstandard when it ends in ".zst"
// (concatenated frames too), else the bytes as they are. Only a buffer of the decompressed text
// is held, so a reader of lines never has the whole file in memory.
//
// A corrupt or truncated stream (a bad block, a CRC or checksum that does not match, the file
// ending inside a member or frame) is an Error naming the file and the compressed byte offset
// where the decoder found it (zstd: the 64 KiB of input it was given then): for a bad checksum
// that is the end of the member or frame it covers, since the check can only be made there.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace loom {

enum class Compression { none, gzip, zstd };

// The compression a file's name says: ".gz" gzip, ".zst" Zstandard, else none.
Compression compression_of(const std::string& path);
// The name under the compression suffix ("x.jsonl.gz" -> "x.jsonl"); the name itself when none.
std::string without_compression_suffix(const std::string& path);
const char* compression_name(Compression c);  // "gzip", "zstd", "none"

class CompressedReader {
 public:
  explicit CompressedReader(const std::string& path);  // opens; errors name the file
  ~CompressedReader();
  CompressedReader(const CompressedReader&) = delete;
  CompressedReader& operator=(const CompressedReader&) = delete;

  // Up to n bytes of the decompressed text into buf; 0 only at its end.
  size_t read(char* buf, size_t n);
  // The next line without its '\n' (a last line that has none too); false at the end.
  bool read_line(std::string& line);
  // The rest of the decompressed text.
  std::string read_all();

  const std::string& path() const { return path_; }
  Compression compression() const { return compression_; }
  // Bytes of the file the decoder has consumed so far: the progress through the file, and the
  // offset that errors name.
  uint64_t compressed_offset() const;
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  struct Decoder;  // zlib's or zstd's state, kept out of this header
  struct FileCloser {
    void operator()(std::FILE* f) const;
  };

  bool fill();  // decodes more text into out_; false at the end of the stream
  size_t read_file(uint8_t* buf, size_t n);
  // fed: the bytes the decoder was given when it found the error, when it does not say which of
  // them it was at (zstd); 0 when the offset is exact (zlib).
  [[noreturn]] void corrupt(const std::string& what, uint64_t fed = 0) const;

  std::string path_;
  Compression compression_ = Compression::none;
  std::unique_ptr<std::FILE, FileCloser> file_;
  uint64_t file_bytes_ = 0, file_read_ = 0;  // the file's size, bytes read from it
  bool file_eof_ = false;
  std::unique_ptr<Decoder> decoder_;
  std::vector<char> out_;  // decoded text not yet handed out: [out_pos_, out_end_)
  size_t out_pos_ = 0, out_end_ = 0;
};

}  // namespace loom
