#include "model/checksum.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/error.hpp"

namespace loom {

namespace {

constexpr std::string_view kPrefix = "xxh3-64:";

}  // namespace

struct Checksum::State {
  struct Free {
    void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
  };
  std::unique_ptr<XXH3_state_t, Free> xxh{XXH3_createState()};
};

Checksum::Checksum() : state_(std::make_unique<State>()) {
  LOOM_CHECK(state_->xxh != nullptr, "checksum: cannot allocate an XXH3 state");
  XXH3_64bits_reset(state_->xxh.get());
}

Checksum::~Checksum() = default;

void Checksum::update(const void* data, size_t n) {
  if (n > 0) XXH3_64bits_update(state_->xxh.get(), data, n);
}

uint64_t Checksum::digest() const {
  return XXH3_64bits_digest(state_->xxh.get());
}

uint64_t checksum_of(std::string_view bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

uint64_t checksum_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open '", path, "' to verify its checksum: ", std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close{fd};
  // Read once, front to back: the kernel may read ahead as far as it likes.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  // 1 MiB pieces: large enough that the syscalls cost nothing, small enough to stay in cache
  // between the copy and the hash.
  std::vector<char> buf(size_t(1) << 20);
  Checksum sum;
  for (;;) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail("cannot read '", path, "' to verify its checksum: ", std::strerror(errno));
    if (r == 0) break;
    sum.update(buf.data(), size_t(r));
  }
  return sum.digest();
}

std::string checksum_text(uint64_t checksum) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(checksum));
  return std::string(kPrefix) + buf;
}

std::optional<uint64_t> parse_checksum(std::string_view text) {
  if (text.size() != kPrefix.size() + 16 || text.substr(0, kPrefix.size()) != kPrefix)
    return std::nullopt;
  uint64_t v = 0;
  for (char c : text.substr(kPrefix.size())) {
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (d < 0) return std::nullopt;
    v = v << 4 | uint64_t(d);
  }
  return v;
}

}  // namespace loom
