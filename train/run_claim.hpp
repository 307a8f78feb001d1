#pragma once
// What a training run claims before it trains: its checkpoint directory, locked against a second
// run and proven writable with room for a checkpoint, and its metrics file, protected from a fresh
// run that would truncate another run's history, and its TensorBoard directory, proven writable
// and kept from mixing two runs' events. Each refusal comes before any work is done.
#include <cstdint>
#include <string>

namespace loom {

// An advisory lock (flock) on <dir>/loom.lock, held from acquire() to destruction by world rank 0,
// the file holding the holder's "pid=N host=H started=TIME". flock is released by the kernel when
// the holder dies, so a lock file that is not locked but still names a holder is stale: it is taken
// over, with a note naming the dead holder. A clean release empties the file.
class CheckpointDirLock {
 public:
  CheckpointDirLock() = default;
  // Creates `dir` if needed. loom::Error naming the holder when another process holds the lock
  // (a run, or a resume, on the same directory); `note` gets a line when a stale lock was taken.
  static CheckpointDirLock acquire(const std::string& dir, std::string* note);
  ~CheckpointDirLock();
  CheckpointDirLock(CheckpointDirLock&& other) noexcept;
  CheckpointDirLock& operator=(CheckpointDirLock&& other) noexcept;
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

  bool held() const { return fd_ >= 0; }
  static constexpr const char* kFileName = "loom.lock";

 private:
  explicit CheckpointDirLock(int fd) : fd_(fd) {}
  void release();
  int fd_ = -1;
};

// Writes and deletes a probe file in `dir` (an existing directory), and compares its file
// system's free space with `checkpoint_bytes`: loom::Error when the probe cannot be written (not
// writable, read-only, ...) or when not one checkpoint fits; a note when fewer than `keep` + 1 fit
// (a later save would fail once keep checkpoints are on disk; keep = 0: every save stays).
void check_checkpoint_dir_writable(const std::string& dir, uint64_t checkpoint_bytes, int64_t keep,
                                   std::string* note);

// For a fresh run (nothing resumed): loom::Error when `path` exists with lines in it, naming how
// many and the last step, unless `overwrite` (then the file is replaced as the run starts).
void check_metrics_file_free(const std::string& path, bool overwrite);

// [metrics] tensorboard: creates `dir` if needed and writes and deletes a probe file there:
// loom::Error naming the directory when it cannot be made (a path under a regular file, no
// permission) or written. A no-op for "" (no TensorBoard files).
void check_tensorboard_dir_writable(const std::string& dir);

// For a fresh run: loom::Error when `dir` holds event files with another run's events, naming how
// many and the last step, unless `overwrite` (then the run removes them as it starts).
void check_tensorboard_dir_free(const std::string& dir, bool overwrite);

}  // namespace loom
