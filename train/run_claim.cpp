#include "train/run_claim.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "core/error.hpp"
#include "train/tensorboard_writer.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

std::string gib_text(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(uint64_t(1) << 30));
  return buf;
}

std::string holder_text() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  char when[32] = {};
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return str_cat("pid=", getpid(), " host=", host, " started=", when);
}

// The lock file's text, without its newline ("" when empty or unreadable).
std::string read_holder(int fd) {
  std::string text(512, '\0');
  const ssize_t n = pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? size_t(n) : 0);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text;
}

}  // namespace

CheckpointDirLock CheckpointDirLock::acquire(const std::string& dir, std::string* note) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    fail("checkpoint.dir '", dir, "' exists and is not a directory (expected a directory, or a ",
         "path where one can be created)");
  fs::create_directories(dir, ec);
  LOOM_CHECK(!ec, "checkpoint.dir '", dir, "' cannot be created: ", ec.message());
  const std::string path = (fs::path(dir) / kFileName).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  LOOM_CHECK(fd >= 0, "checkpoint.dir '", dir, "' is not writable: cannot create its lock file '",
             path, "': ", std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = read_holder(fd);
    // Closed without the release's truncation: the file is the holder's.
    ::close(fd);
    LOOM_CHECK(err == EWOULDBLOCK, "checkpoint.dir '", dir, "': cannot lock '", path,
               "': ", std::strerror(err));
    fail("checkpoint.dir '", dir, "' is in use by another loom run (",
         holder.empty() ? "holder unknown" : holder, "; lock file ", path,
         "): one run at a time per checkpoint directory, since both would save and prune the same "
         "checkpoints. Wait for that run to end or stop it, or give this run another "
         "checkpoint.dir");
  }
  CheckpointDirLock lock(fd);
  // Not locked, yet naming a holder: that process died without its clean release.
  const std::string stale = read_holder(fd);
  if (!stale.empty() && note)
    *note = str_cat("  note: took over the lock of checkpoint.dir '", dir, "' from a run that ",
                    "ended without releasing it (", stale, ")");
  const std::string me = holder_text() + "\n";
  const bool written = ::ftruncate(fd, 0) == 0 &&
                       ::pwrite(fd, me.data(), me.size(), 0) == ssize_t(me.size()) &&
                       ::fsync(fd) == 0;
  LOOM_CHECK(written, "checkpoint.dir '", dir, "' is not writable: cannot write its lock file '",
             path, "': ", std::strerror(errno));
  return lock;
}

void CheckpointDirLock::release() {
  if (fd_ < 0) return;
  // Emptied first, so that the next run does not take the file for a dead holder's.
  if (::ftruncate(fd_, 0) != 0) {
    // Nothing to do: the next run will report a stale lock, which is harmless.
  }
  ::close(fd_);  // releases the flock
  fd_ = -1;
}

CheckpointDirLock::~CheckpointDirLock() {
  release();
}

CheckpointDirLock::CheckpointDirLock(CheckpointDirLock&& other) noexcept : fd_(other.fd_) {
  other.fd_ = -1;
}

CheckpointDirLock& CheckpointDirLock::operator=(CheckpointDirLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void check_checkpoint_dir_writable(const std::string& dir, uint64_t checkpoint_bytes, int64_t keep,
                                   std::string* note) {
  // A probe of a page, written and synced: creating a file is not enough where a quota or a
  // read-only remount refuses the data.
  const std::string probe = (fs::path(dir) / str_cat(".loom-probe-", getpid())).string();
  {
    errno = 0;
    std::ofstream f(probe, std::ios::binary | std::ios::trunc);
    const std::string page(4096, '\0');
    f.write(page.data(), std::streamsize(page.size()));
    f.flush();
    const bool ok = f.good();
    f.close();
    std::error_code ec;
    fs::remove(probe, ec);
    LOOM_CHECK(ok && !ec, "checkpoint.dir '", dir, "' is not writable: a test write of '", probe,
               "' failed", errno ? str_cat(": ", std::strerror(errno)) : std::string(),
               " (expected a writable directory; this is checked before training so that no "
               "work is lost at the first save)");
  }
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return;  // unknown: the save's own errors will say
  const uint64_t free_bytes = uint64_t(vfs.f_bavail) * uint64_t(vfs.f_frsize);
  LOOM_CHECK(free_bytes >= checkpoint_bytes, "checkpoint.dir '", dir, "' has ",
             gib_text(free_bytes), " free, less than one checkpoint of this model (about ",
             gib_text(checkpoint_bytes),
             ": f32 weights and both AdamW moments); free space or use another checkpoint.dir");
  // A new checkpoint is complete before the oldest is pruned: keep + 1 are on disk at once.
  if (keep > 0 && note && free_bytes < checkpoint_bytes * uint64_t(keep + 1))
    *note = str_cat("  note: checkpoint.dir '", dir, "' has ", gib_text(free_bytes),
                    " free, less than checkpoint.keep + 1 = ", keep + 1, " checkpoints of about ",
                    gib_text(checkpoint_bytes), " each: a later save may fail for lack of space");
}

void check_metrics_file_free(const std::string& path, bool overwrite) {
  std::error_code ec;
  if (path.empty() || overwrite || !fs::is_regular_file(path, ec)) return;
  std::ifstream in(path);
  int64_t lines = 0, last_step = -1;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    ++lines;
    static constexpr std::string_view key = "{\"step\": ";
    int64_t step = -1;
    if (line.compare(0, key.size(), key) == 0 &&
        std::from_chars(line.data() + key.size(), line.data() + line.size(), step).ec ==
            std::errc())
      last_step = step;
  }
  if (lines == 0) return;
  fail("metrics.jsonl '", path, "' already holds ", lines, " lines of another run",
       last_step >= 0 ? str_cat(" (up to step ", last_step, ")") : std::string(),
       ", which this fresh run would truncate. Resume that run (--checkpoint.resume=true with "
       "its checkpoint.dir) to append to them, move the file away or give this run another "
       "--metrics.jsonl, or set --metrics.overwrite=true to replace it");
}

void check_tensorboard_dir_writable(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    fail("metrics.tensorboard '", dir, "' exists and is not a directory (expected a directory ",
         "for TensorBoard's event files, or \"\" for none)");
  fs::create_directories(dir, ec);
  LOOM_CHECK(!ec && fs::is_directory(dir), "metrics.tensorboard '", dir, "' cannot be created",
             ec ? str_cat(": ", ec.message()) : std::string(),
             " (expected a directory for TensorBoard's event files, or \"\" for none)");
  const std::string probe = (fs::path(dir) / str_cat(".loom-probe-", getpid())).string();
  errno = 0;
  std::ofstream f(probe, std::ios::binary | std::ios::trunc);
  f << "probe\n";
  f.flush();
  const bool ok = f.good();
  const int err = errno;
  f.close();
  fs::remove(probe, ec);
  LOOM_CHECK(ok, "metrics.tensorboard '", dir, "' is not writable: a test write of '", probe,
             "' failed", err ? str_cat(": ", std::strerror(err)) : std::string(),
             " (expected a writable directory, or \"\" for no TensorBoard files; this is checked ",
             "before training so that no step goes unrecorded)");
}

void check_tensorboard_dir_free(const std::string& dir, bool overwrite) {
  if (dir.empty() || overwrite) return;
  const std::vector<std::string> files = tensorboard_event_files(dir);
  const TensorBoardHistory h = tensorboard_history(files);
  if (h.events == 0) return;
  fail("metrics.tensorboard '", dir, "' already holds ", h.events, " events of another run in ",
       files.size(), files.size() == 1 ? " event file" : " event files", " (up to step ",
       h.last_step, "), which TensorBoard would show mixed with this fresh run's. Resume that run ",
       "(--checkpoint.resume=true with its checkpoint.dir) to append to them, move them away or ",
       "give this run another --metrics.tensorboard, or set --metrics.overwrite=true to replace ",
       "them");
}

}  // namespace loom
