#include "data/compressed_reader.hpp"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.hpp"

namespace loom {

namespace {

constexpr size_t kInBytes = size_t(256) << 10;  // compressed bytes read from the file at a time
constexpr size_t kOutBytes = size_t(1) << 20;   // decoded text held at a time
// zstd does not say how far into its input an error was found, only that it was in the input of
// that call: input is given 64 KiB at a time to narrow where an error is down to that.
constexpr size_t kZstdFeedBytes = size_t(64) << 10;

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

Compression compression_of(const std::string& path) {
  if (ends_with(path, ".gz")) return Compression::gzip;
  if (ends_with(path, ".zst")) return Compression::zstd;
  return Compression::none;
}

std::string without_compression_suffix(const std::string& path) {
  switch (compression_of(path)) {
    case Compression::gzip:
      return path.substr(0, path.size() - 3);
    case Compression::zstd:
      return path.substr(0, path.size() - 4);
    case Compression::none:
      break;
  }
  return path;
}

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::gzip:
      return "gzip";
    case Compression::zstd:
      return "zstd";
    case Compression::none:
      break;
  }
  return "none";
}

// The compressed bytes read from the file but not yet consumed, and the decoder's state.
struct CompressedReader::Decoder {
  std::vector<uint8_t> in = std::vector<uint8_t>(kInBytes);
  size_t in_pos = 0, in_end = 0;
  z_stream zs{};
  bool zs_live = false;
  bool in_member = false;  // inside a gzip member: input given since its start, no end seen yet
  ZSTD_DCtx* dctx = nullptr;
  size_t zstd_hint = 0;  // ZSTD_decompressStream's last return: 0 when a frame is complete

  Decoder() = default;
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  ~Decoder() {
    if (zs_live) inflateEnd(&zs);
    ZSTD_freeDCtx(dctx);  // accepts null
  }
};

void CompressedReader::FileCloser::operator()(std::FILE* f) const {
  std::fclose(f);
}

CompressedReader::CompressedReader(const std::string& path)
    : path_(path), compression_(compression_of(path)), out_(kOutBytes) {
  file_.reset(std::fopen(path.c_str(), "rb"));
  LOOM_CHECK(file_, "cannot open input '", path, "': ", std::strerror(errno));
  LOOM_CHECK(std::fseek(file_.get(), 0, SEEK_END) == 0, "cannot seek in input '", path,
             "': ", std::strerror(errno));
  const long size = std::ftell(file_.get());
  LOOM_CHECK(size >= 0, "cannot read the size of input '", path, "': ", std::strerror(errno));
  file_bytes_ = uint64_t(size);
  std::rewind(file_.get());
  if (compression_ == Compression::none) return;
  decoder_ = std::make_unique<Decoder>();
  if (compression_ == Compression::gzip) {
    // 16 + MAX_WBITS: a gzip header and trailer (CRC-32 and length checked), no zlib wrapper.
    const int rc = inflateInit2(&decoder_->zs, 16 + MAX_WBITS);
    LOOM_CHECK(rc == Z_OK, "input '", path, "': zlib cannot start a decoder (error ", rc, ")");
    decoder_->zs_live = true;
  } else {
    decoder_->dctx = ZSTD_createDCtx();
    LOOM_CHECK(decoder_->dctx, "input '", path, "': cannot allocate a zstd decoder");
  }
}

CompressedReader::~CompressedReader() = default;

uint64_t CompressedReader::compressed_offset() const {
  if (!decoder_) return file_read_ - (out_end_ - out_pos_);
  return file_read_ - (decoder_->in_end - decoder_->in_pos);
}

size_t CompressedReader::read_file(uint8_t* buf, size_t n) {
  const size_t got = std::fread(buf, 1, n, file_.get());
  LOOM_CHECK(!std::ferror(file_.get()), "cannot read input '", path_, "' at byte ", file_read_,
             ": ", std::strerror(errno));
  file_read_ += got;
  if (got < n) file_eof_ = true;
  return got;
}

void CompressedReader::corrupt(const std::string& what, uint64_t fed) const {
  const uint64_t at = compressed_offset();
  if (fed == 0)
    fail("input '", path_, "' is not valid ", compression_name(compression_), " data: ", what,
         ", found at compressed byte ", at, " of ", file_bytes_);
  fail("input '", path_, "' is not valid ", compression_name(compression_), " data: ", what,
       ", found between compressed bytes ", at, " and ", at + fed, " of ", file_bytes_);
}

bool CompressedReader::fill() {
  out_pos_ = out_end_ = 0;
  if (!decoder_) {
    if (file_eof_) return false;
    out_end_ = read_file(reinterpret_cast<uint8_t*>(out_.data()), out_.size());
    return out_end_ > 0;
  }
  Decoder& d = *decoder_;
  auto refill = [&] {
    if (d.in_pos < d.in_end || file_eof_) return;
    d.in_pos = 0;
    d.in_end = read_file(d.in.data(), d.in.size());
  };
  if (compression_ == Compression::gzip) {
    z_stream& zs = d.zs;
    for (;;) {
      refill();
      const bool input_done = d.in_pos == d.in_end && file_eof_;
      // Between members with no input left: the stream's end.
      if (input_done && !d.in_member) return false;
      zs.next_in = d.in.data() + d.in_pos;
      zs.avail_in = uInt(d.in_end - d.in_pos);
      zs.next_out = reinterpret_cast<Bytef*>(out_.data());
      zs.avail_out = uInt(out_.size());
      const int rc = inflate(&zs, Z_NO_FLUSH);
      d.in_pos = d.in_end - zs.avail_in;
      out_end_ = out_.size() - zs.avail_out;
      if (rc == Z_STREAM_END) {
        // The member's CRC-32 and length matched; another member may follow (`cat a.gz b.gz`).
        d.in_member = false;
        LOOM_CHECK(inflateReset(&zs) == Z_OK, "input '", path_, "': zlib cannot reset");
      } else if (rc == Z_OK) {
        d.in_member = true;
      } else if (rc == Z_BUF_ERROR) {
        // No progress: more input is needed, and at the file's end there is none.
        if (input_done) corrupt("the file ends inside a gzip member (truncated?)");
      } else {
        corrupt(zs.msg ? zs.msg : str_cat("zlib error ", rc));
      }
      if (out_end_ > 0) return true;
    }
  }
  for (;;) {
    refill();
    const bool input_done = d.in_pos == d.in_end && file_eof_;
    if (input_done && d.zstd_hint == 0) return false;  // every frame complete
    const size_t feed = std::min(d.in_end - d.in_pos, kZstdFeedBytes);
    ZSTD_inBuffer ib{d.in.data() + d.in_pos, feed, 0};
    ZSTD_outBuffer ob{out_.data(), out_.size(), 0};
    const size_t rc = ZSTD_decompressStream(d.dctx, &ob, &ib);
    // On an error zstd leaves ib.pos unset: the error is somewhere in the bytes fed.
    if (ZSTD_isError(rc)) corrupt(ZSTD_getErrorName(rc), feed);
    d.in_pos += ib.pos;
    out_end_ = ob.pos;
    d.zstd_hint = rc;
    if (out_end_ > 0) return true;
    // Text the decoder still held has been flushed: what is left of a frame needs input.
    if (input_done) corrupt("the file ends inside a zstd frame (truncated?)");
  }
}

size_t CompressedReader::read(char* buf, size_t n) {
  size_t done = 0;
  while (done < n) {
    if (out_pos_ == out_end_ && !fill()) break;
    const size_t take = std::min(n - done, out_end_ - out_pos_);
    std::memcpy(buf + done, out_.data() + out_pos_, take);
    out_pos_ += take;
    done += take;
  }
  return done;
}

bool CompressedReader::read_line(std::string& line) {
  line.clear();
  bool any = false;  // a last line without '\n' is a line too
  for (;;) {
    if (out_pos_ == out_end_ && !fill()) return any;
    any = true;
    const char* begin = out_.data() + out_pos_;
    const size_t avail = out_end_ - out_pos_;
    const void* nl = std::memchr(begin, '\n', avail);
    if (nl) {
      const size_t len = size_t(static_cast<const char*>(nl) - begin);
      line.append(begin, len);
      out_pos_ += len + 1;
      return true;
    }
    line.append(begin, avail);
    out_pos_ = out_end_;
  }
}

std::string CompressedReader::read_all() {
  std::string s;
  if (!decoder_) s.reserve(size_t(file_bytes_ - file_read_));
  for (;;) {
    if (out_pos_ == out_end_ && !fill()) return s;
    s.append(out_.data() + out_pos_, out_end_ - out_pos_);
    out_pos_ = out_end_;
  }
}

}  // namespace loom
