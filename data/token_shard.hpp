#pragma once
// Token shards (docs/design.md "The command line", `loom tokenize`): a 64-byte little-endian header
// (magic "LOOMTOKS", u32 version 1, u32 token_bytes 2 or 4, u64 vocab_size, u64 num_tokens, 32 zero
// bytes), then num_tokens ids of token_bytes each. Read by memory mapping; a shard is validated on
// open (magic, version, token_bytes, file size == 64 + num_tokens * token_bytes, reserved bytes
// zero, every id below vocab_size).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace loom {

struct ShardHeader {
  uint32_t version = 1;
  uint32_t token_bytes = 2;
  uint64_t vocab_size = 0;
  uint64_t num_tokens = 0;
};

// Writes atomically (a temporary file beside it, fsync, rename, fsync of the directory), so a
// reader sees the old shard or the whole new one; token_bytes is 2 if vocab_size <= 65536 else 4.
// An id outside [0, vocab_size) is an error naming it and its position; nothing is written then.
void write_shard(const std::string& path, const int32_t* tokens, uint64_t num_tokens,
                 uint64_t vocab_size);
void write_shard(const std::string& path, const std::vector<int32_t>& tokens, uint64_t vocab_size);

class Shard {
 public:
  explicit Shard(const std::string& path);  // maps and validates; errors name the file
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;
  const ShardHeader& header() const { return h_; }
  const std::string& path() const { return path_; }
  uint64_t size() const { return h_.num_tokens; }
  int32_t operator[](uint64_t i) const;
  // Copies tokens [begin, begin + n) into out (n <= size() - begin). An id >= vocab_size in the
  // file is an error naming the file and the position (checked at open, in parallel, and again
  // as they are read, in case the file changed under the mapping).
  void read(uint64_t begin, uint64_t n, int32_t* out) const;

 private:
  std::string path_;
  ShardHeader h_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
};

// The shards of one split of a dataset directory (`train` or `val`: files `<split>-*.bin`,
// in name order) read as one stream of tokens. All shards must share one vocab_size.
class TokenStream {
 public:
  // Errors if `dir` holds no `<split>-*.bin`, if the shards' vocab sizes differ, or if they hold
  // no tokens at all.
  TokenStream(const std::string& dir, const std::string& split);
  // The paths of `dir`'s `<split>-*.bin` files in name order; empty if there are none (so a
  // trainer can tell whether a dataset has a `val` split before opening it).
  static std::vector<std::string> find_files(const std::string& dir, const std::string& split);
  uint64_t size() const { return total_; }
  uint64_t vocab_size() const { return vocab_; }
  // Copies n tokens starting at `begin`, wrapping around at the end of the stream.
  void read(uint64_t begin, uint64_t n, int32_t* out) const;
  const std::vector<std::string>& files() const { return files_; }

 private:
  std::vector<std::string> files_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<uint64_t> starts_;
  uint64_t total_ = 0, vocab_ = 0;
};

}  // namespace loom
