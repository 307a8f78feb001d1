#pragma once
// File checksums of checkpoints (docs/decisions/distributed-checkpoints.md): XXH3-64 of every
// byte of a file (libxxhash), written as "xxh3-64:<16 lowercase hex digits>". XXH3 hashes at
// memory speed (tens of GB/s a core), so hashing while writing costs nothing next to the write,
// and a resume's verification costs one read of the checkpoint. It detects corruption (flipped
// bits, torn or swapped files), not tampering: it is no cryptographic hash.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace loom {

// Hashes a byte stream piece by piece: the digest of the concatenated pieces.
class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

uint64_t checksum_of(std::string_view bytes);
// Reads the whole file (errors name it: missing, unreadable).
uint64_t checksum_file(const std::string& path);

// "xxh3-64:0123456789abcdef", and back: nullopt for text of another form (another algorithm, a
// digit missing), which a reader reports with the text it found.
std::string checksum_text(uint64_t checksum);
std::optional<uint64_t> parse_checksum(std::string_view text);

}  // namespace loom
