#include "train/run_claim.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

struct RunClaimTest : ::testing::Test {
  fs::path dir;
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir = fs::temp_directory_path() / str_cat("loom_claim_", ::getpid(), "_", info->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The message of the loom::Error that `fn` throws ("" when it throws none).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// flock locks belong to open file descriptions: a second acquire in this very process conflicts as
// another process's would, and names the holder written in the file.
TEST_F(RunClaimTest, SecondAcquireIsRefusedNamingTheHolder) {
  const std::string ck = path("ck");
  std::string note;
  CheckpointDirLock first = CheckpointDirLock::acquire(ck, &note);
  EXPECT_TRUE(first.held());
  EXPECT_EQ(note, "");  // a fresh directory: nobody to take over from
  const std::string lock_file = path("ck/loom.lock");
  EXPECT_NE(slurp(lock_file).find(str_cat("pid=", ::getpid(), " host=")), std::string::npos)
      << slurp(lock_file);
  const std::string e = error_of([&] { CheckpointDirLock::acquire(ck, nullptr); });
  EXPECT_NE(e.find("is in use by another loom run (pid=" + std::to_string(::getpid())),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(lock_file), std::string::npos) << e;
  // The refused acquire leaves the holder's text in place, for the next one to name.
  EXPECT_NE(slurp(lock_file).find(str_cat("pid=", ::getpid(), " host=")), std::string::npos);
  // Released: emptied, and free for the next run without a note.
  first = CheckpointDirLock();
  EXPECT_EQ(slurp(lock_file), "");
  note.clear();
  CheckpointDirLock again = CheckpointDirLock::acquire(ck, &note);
  EXPECT_TRUE(again.held());
  EXPECT_EQ(note, "");
}

// A holder that died keeps its text in the file but no lock: taken over, with a note naming it.
TEST_F(RunClaimTest, StaleLockIsTakenOverWithANote) {
  fs::create_directories(path("ck"));
  std::ofstream(path("ck/loom.lock"))
      << "pid=99999999 host=elsewhere started=2026-01-01T00:00:00Z\n";
  std::string note;
  CheckpointDirLock lock = CheckpointDirLock::acquire(path("ck"), &note);
  EXPECT_TRUE(lock.held());
  EXPECT_NE(note.find("took over the lock"), std::string::npos) << note;
  EXPECT_NE(note.find("pid=99999999 host=elsewhere"), std::string::npos) << note;
  EXPECT_NE(slurp(path("ck/loom.lock")).find(str_cat("pid=", ::getpid())), std::string::npos);
}

TEST_F(RunClaimTest, UnusableDirectoriesAreRefused) {
  std::ofstream(path("file")) << "x";
  std::string e = error_of([&] { CheckpointDirLock::acquire(path("file"), nullptr); });
  EXPECT_NE(e.find("checkpoint.dir '" + path("file") + "' exists and is not a directory"),
            std::string::npos)
      << e;
  // Under a regular file nothing can be created, whoever runs the test (even root).
  e = error_of([&] { CheckpointDirLock::acquire(path("file/sub"), nullptr); });
  EXPECT_NE(e.find("cannot be created"), std::string::npos) << e;
}

TEST_F(RunClaimTest, FreeSpaceIsComparedWithACheckpoint) {
  std::string note;
  // A small checkpoint fits anywhere the test runs; the probe is gone afterwards.
  check_checkpoint_dir_writable(dir.string(), 1 << 20, 2, &note);
  EXPECT_EQ(note, "");
  EXPECT_TRUE(fs::is_empty(dir));
  // No file system has 2^62 bytes free: refused, naming the sizes.
  const std::string e =
      error_of([&] { check_checkpoint_dir_writable(dir.string(), uint64_t(1) << 62, 2, nullptr); });
  EXPECT_NE(e.find("free, less than one checkpoint of this model"), std::string::npos) << e;
  // keep + 1 checkpoints that do not fit, while one does: a note, not an error.
  const auto space = fs::space(dir);
  check_checkpoint_dir_writable(dir.string(), space.available / 2, 3, &note);
  EXPECT_NE(note.find("less than checkpoint.keep + 1 = 4 checkpoints"), std::string::npos) << note;
}

TEST_F(RunClaimTest, MetricsOfAnotherRunAreNotTruncated) {
  const std::string m = path("metrics.jsonl");
  check_metrics_file_free(m, false);  // absent: free
  std::ofstream(m) << "";
  check_metrics_file_free(m, false);  // empty: free
  const std::string lines =
      "{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"val_loss\": 4}\n{\"step\": 2, \"loss\": 4.5}\n";
  std::ofstream(m) << lines;
  const std::string e = error_of([&] { check_metrics_file_free(m, false); });
  EXPECT_NE(e.find("metrics.jsonl '" + m + "' already holds 3 lines of another run (up to step 2)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--metrics.overwrite=true"), std::string::npos) << e;
  check_metrics_file_free(m, true);  // told to overwrite
  EXPECT_EQ(slurp(m), lines);        // checking never changes the file
}
