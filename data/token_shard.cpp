#include "data/token_shard.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.hpp"

namespace loom {

// The format is little-endian and ids are copied with memcpy; a big-endian port would need a
// byte swap in encode_ids/decode_ids.
static_assert(std::endian::native == std::endian::little,
              "token shards assume a little-endian host");

namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', 'S'};
constexpr uint64_t kHeaderBytes = 64;
constexpr uint32_t kVersion = 1;
// Ids are int32 in memory, so a vocabulary may not need more than 31 bits.
constexpr uint64_t kMaxVocab = uint64_t(1) << 31;

std::string errno_text() {
  return std::strerror(errno);
}

struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("cannot write shard '", path, "': ", errno_text());
    }
    p += w;
    n -= size_t(w);
  }
}

void put_u32(uint8_t* p, uint32_t v) {
  std::memcpy(p, &v, 4);
}
void put_u64(uint8_t* p, uint64_t v) {
  std::memcpy(p, &v, 8);
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

std::string printable(const uint8_t* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = p[i];
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      s += char(c);
    } else {
      const char* hex = "0123456789abcdef";
      s += "\\x";
      s += hex[c >> 4];
      s += hex[c & 15];
    }
  }
  return s;
}

// Widens n ids of `token_bytes` each at `src` into out, then checks them against the vocabulary
// in a separate branch-free pass that the compiler vectorizes; only a failure pays for finding
// the position.
void decode_ids(const uint8_t* src, uint32_t token_bytes, uint64_t n, uint64_t vocab, int32_t* out,
                const std::string& path, uint64_t first_position) {
  if (token_bytes == 4) {
    std::memcpy(out, src, n * 4);
  } else {
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, src + 2 * i, 2);
      out[i] = int32_t(v);
    }
  }
  const uint32_t limit = uint32_t(vocab);  // vocab <= 2^31, so negative int32 ids fail too
  uint32_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) bad |= uint32_t(uint32_t(out[i]) >= limit);
  if (!bad) return;
  for (uint64_t i = 0; i < n; ++i)
    if (uint32_t(out[i]) >= limit)
      fail("shard '", path, "': token ", uint32_t(out[i]), " at position ", first_position + i,
           " is not below the vocab_size ", vocab);
}

// Every id of a mapped shard below `vocab`, checked once when the shard is opened: a bad id
// found only when training reaches it (late in a long run) would waste the run up to there.
// Chunks are scanned in parallel; the first chunk with a bad id is decoded again to name it.
void check_ids(const uint8_t* data, uint32_t token_bytes, uint64_t n, uint64_t vocab,
               const std::string& path) {
  if (token_bytes == 2 && vocab >= 65536) return;  // every 2-byte id is in range
  constexpr uint64_t kChunk = uint64_t(1) << 20;
  const int64_t chunks = int64_t((n + kChunk - 1) / kChunk);
  const uint32_t limit = uint32_t(vocab);
  int64_t first_bad = chunks;
#pragma omp parallel for schedule(static) reduction(min : first_bad)
  for (int64_t c = 0; c < chunks; ++c) {
    const uint64_t b = uint64_t(c) * kChunk, e = std::min(n, b + kChunk);
    uint32_t bad = 0;
    if (token_bytes == 4) {
      for (uint64_t i = b; i < e; ++i) {
        uint32_t v;
        std::memcpy(&v, data + 4 * i, 4);
        bad |= uint32_t(v >= limit);
      }
    } else {
      for (uint64_t i = b; i < e; ++i) {
        uint16_t v;
        std::memcpy(&v, data + 2 * i, 2);
        bad |= uint32_t(v >= limit);
      }
    }
    if (bad) first_bad = std::min(first_bad, c);
  }
  if (first_bad == chunks) return;
  const uint64_t b = uint64_t(first_bad) * kChunk, m = std::min(kChunk, n - b);
  std::vector<int32_t> ids(m);
  decode_ids(data + b * token_bytes, token_bytes, m, vocab, ids.data(), path, b);  // throws
}

}  // namespace

void write_shard(const std::string& path, const int32_t* tokens, uint64_t num_tokens,
                 uint64_t vocab_size) {
  LOOM_CHECK(vocab_size >= 1 && vocab_size <= kMaxVocab, "shard '", path, "': vocab_size ",
             vocab_size, " is outside [1, 2^31]");
  LOOM_CHECK(num_tokens == 0 || tokens != nullptr, "shard '", path, "': no token data");
  const uint32_t limit = uint32_t(vocab_size);
  uint32_t bad = 0;
  for (uint64_t i = 0; i < num_tokens; ++i) bad |= uint32_t(uint32_t(tokens[i]) >= limit);
  if (bad)
    for (uint64_t i = 0; i < num_tokens; ++i)
      if (uint32_t(tokens[i]) >= limit)
        fail("shard '", path, "': token ", tokens[i], " at position ", i, " is outside [0, ",
             vocab_size, ")");

  const uint32_t token_bytes = vocab_size <= 65536 ? 2 : 4;
  uint8_t header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, 8);
  put_u32(header + 8, kVersion);
  put_u32(header + 12, token_bytes);
  put_u64(header + 16, vocab_size);
  put_u64(header + 24, num_tokens);

  // The temporary name carries the pid so that two processes writing the same dataset cannot
  // interleave inside one file; the rename makes the last complete one win.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  struct Unlink {
    const std::string& p;
    bool armed = true;
    ~Unlink() {
      if (armed) ::unlink(p.c_str());
    }
  } cleanup{tmp};
  {
    Fd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd < 0) {
      cleanup.armed = false;
      fail("cannot create shard '", tmp, "': ", errno_text());
    }
    write_all(f.fd, header, kHeaderBytes, tmp);
    if (token_bytes == 4) {
      write_all(f.fd, tokens, num_tokens * 4, tmp);
    } else {
      // Narrowed in chunks so the copy stays small whatever the shard size.
      constexpr uint64_t kChunk = uint64_t(1) << 20;
      std::vector<uint16_t> buf(std::min(num_tokens, kChunk));
      for (uint64_t b = 0; b < num_tokens; b += kChunk) {
        const uint64_t n = std::min(kChunk, num_tokens - b);
        for (uint64_t i = 0; i < n; ++i) buf[i] = uint16_t(tokens[b + i]);
        write_all(f.fd, buf.data(), n * 2, tmp);
      }
    }
    if (::fsync(f.fd) != 0) fail("cannot fsync shard '", tmp, "': ", errno_text());
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) fail("cannot close shard '", tmp, "': ", errno_text());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    fail("cannot rename '", tmp, "' to '", path, "': ", errno_text());
  cleanup.armed = false;
  // Makes the rename itself durable; some file systems refuse fsync on a directory, which only
  // loses durability, not correctness, so failures here are ignored.
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd >= 0) (void)::fsync(d.fd);
}

void write_shard(const std::string& path, const std::vector<int32_t>& tokens, uint64_t vocab_size) {
  write_shard(path, tokens.data(), tokens.size(), vocab_size);
}

Shard::Shard(const std::string& path) : path_(path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) fail("cannot open shard '", path, "': ", errno_text());
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail("cannot stat shard '", path, "': ", errno_text());
  LOOM_CHECK(S_ISREG(st.st_mode), "shard '", path, "' is not a regular file");
  const uint64_t file_bytes = uint64_t(st.st_size);
  LOOM_CHECK(file_bytes >= kHeaderBytes, "shard '", path, "' is truncated: ", file_bytes,
             " bytes, smaller than the ", kHeaderBytes, "-byte header");

  // The header is validated before mapping, so a bad file never leaves a mapping behind.
  uint8_t hb[kHeaderBytes];
  uint64_t got = 0;
  while (got < kHeaderBytes) {
    const ssize_t r = ::pread(f.fd, hb + got, kHeaderBytes - got, off_t(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail("cannot read the header of shard '", path, "': ", errno_text());
    got += uint64_t(r);
  }
  LOOM_CHECK(std::memcmp(hb, kMagic, 8) == 0, "shard '", path, "' has a bad magic: expected ",
             "'LOOMTOKS', found '", printable(hb, 8), "'");
  h_.version = get_u32(hb + 8);
  h_.token_bytes = get_u32(hb + 12);
  h_.vocab_size = get_u64(hb + 16);
  h_.num_tokens = get_u64(hb + 24);
  LOOM_CHECK(h_.version == kVersion, "shard '", path, "' has version ", h_.version, ", expected ",
             kVersion);
  LOOM_CHECK(h_.token_bytes == 2 || h_.token_bytes == 4, "shard '", path, "' has token_bytes ",
             h_.token_bytes, ", expected 2 or 4");
  LOOM_CHECK(h_.vocab_size >= 1 && h_.vocab_size <= kMaxVocab, "shard '", path, "' has vocab_size ",
             h_.vocab_size, ", expected 1 to 2^31");
  LOOM_CHECK(h_.token_bytes == 4 || h_.vocab_size <= 65536, "shard '", path,
             "' has token_bytes 2, which cannot hold the ids of its vocab_size ", h_.vocab_size);
  for (uint64_t i = 32; i < kHeaderBytes; ++i)
    LOOM_CHECK(hb[i] == 0, "shard '", path, "' has nonzero reserved header bytes (byte ", i, " is ",
               int(hb[i]), "; bytes 32..63 must be zero)");
  const uint64_t data_bytes = file_bytes - kHeaderBytes;
  if (h_.num_tokens > data_bytes / h_.token_bytes)
    fail("shard '", path, "' is truncated: the header says ", h_.num_tokens, " tokens of ",
         h_.token_bytes, " bytes but the file has only ", data_bytes, " bytes after the header");
  const uint64_t expected = kHeaderBytes + h_.num_tokens * h_.token_bytes;
  LOOM_CHECK(file_bytes == expected, "shard '", path, "' has ", file_bytes,
             " bytes but its header (", h_.num_tokens, " tokens of ", h_.token_bytes,
             " bytes) implies ", expected);

  void* m = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, f.fd, 0);
  if (m == MAP_FAILED) fail("cannot map shard '", path, "': ", errno_text());
  map_ = static_cast<const uint8_t*>(m);
  size_ = file_bytes;
  try {
    check_ids(map_ + kHeaderBytes, h_.token_bytes, h_.num_tokens, h_.vocab_size, path_);
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), size_);
    map_ = nullptr;
    throw;
  }
}

Shard::~Shard() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
}

int32_t Shard::operator[](uint64_t i) const {
  LOOM_CHECK(i < h_.num_tokens, "shard '", path_, "': index ", i, " is out of range (",
             h_.num_tokens, " tokens)");
  int32_t v;
  decode_ids(map_ + kHeaderBytes + i * h_.token_bytes, h_.token_bytes, 1, h_.vocab_size, &v, path_,
             i);
  return v;
}

void Shard::read(uint64_t begin, uint64_t n, int32_t* out) const {
  LOOM_CHECK(begin <= h_.num_tokens && n <= h_.num_tokens - begin, "shard '", path_,
             "': cannot read ", n, " tokens at ", begin, " (", h_.num_tokens, " tokens)");
  decode_ids(map_ + kHeaderBytes + begin * h_.token_bytes, h_.token_bytes, n, h_.vocab_size, out,
             path_, begin);
}

std::vector<std::string> TokenStream::find_files(const std::string& dir, const std::string& split) {
  std::vector<std::string> names;
  std::error_code ec;
  const std::string prefix = split + "-";
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() < prefix.size() + 4 || name.compare(0, prefix.size(), prefix) != 0 ||
        name.compare(name.size() - 4, 4, ".bin") != 0)
      continue;
    std::error_code ec2;
    if (fs::is_regular_file(it->path(), ec2)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  std::vector<std::string> paths;
  for (const auto& n : names) paths.push_back((fs::path(dir) / n).string());
  return paths;
}

TokenStream::TokenStream(const std::string& dir, const std::string& split) {
  std::error_code ec;
  LOOM_CHECK(fs::is_directory(dir, ec), "data directory '", dir,
             "' does not exist or is not a directory");
  files_ = find_files(dir, split);
  LOOM_CHECK(!files_.empty(), "no token shards '", split, "-*.bin' in '", dir,
             "' (make them with `loom tokenize`)");
  for (const auto& f : files_) {
    auto s = std::make_unique<Shard>(f);
    if (shards_.empty()) vocab_ = s->header().vocab_size;
    LOOM_CHECK(s->header().vocab_size == vocab_, "the '", split, "' shards in '", dir,
               "' disagree on vocab_size: '", files_[0], "' has ", vocab_, ", '", f, "' has ",
               s->header().vocab_size);
    starts_.push_back(total_);
    total_ += s->size();
    shards_.push_back(std::move(s));
  }
  LOOM_CHECK(total_ > 0, "the ", files_.size(), " '", split, "-*.bin' shards in '", dir,
             "' hold no tokens");
}

void TokenStream::read(uint64_t begin, uint64_t n, int32_t* out) const {
  uint64_t pos = begin % total_;
  while (n > 0) {
    // The last shard starting at or before pos; empty shards share their start with the next
    // one, so this skips them.
    const size_t k =
        size_t(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
    const uint64_t off = pos - starts_[k];
    const uint64_t m = std::min(n, shards_[k]->size() - off);
    shards_[k]->read(off, m, out);
    out += m;
    n -= m;
    pos += m;
    if (pos == total_) pos = 0;
  }
}

}  // namespace loom
