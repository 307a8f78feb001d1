#include "model/checksum.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

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
  struct stat st;
  if (::fstat(fd, &st) != 0) fail("cannot stat '", path, "': ", std::strerror(errno));
  const size_t size = size_t(st.st_size);
  if (size == 0) return checksum_of({});
  // Mapped rather than read(): no copy, and the pages are left as a load reads them (mapped
  // and referenced), where a read() into a buffer let proactive reclaim (DAMON on this VM)
  // take them as cold between the verification and the load, which then read the disk again.
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED)
    fail("cannot map '", path, "' to verify its checksum: ", std::strerror(errno));
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { ::munmap(p, n); }
  } unmap{map, size};
  ::madvise(map, size, MADV_SEQUENTIAL);  // read once, front to back: read ahead far
  return XXH3_64bits(map, size);
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
