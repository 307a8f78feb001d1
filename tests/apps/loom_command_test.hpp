#pragma once
// A test of a `loom` subcommand through the binary ctest names in LOOM_BIN (skipped without it):
// a temporary folder per test (its name and the pid: other checkouts run the same tests at the
// same time) and run(), which captures a command line's exit code, stdout and stderr.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace loom::test {

struct CommandResult {
  int rc;
  std::string out, err;
};

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class LoomCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* b = std::getenv("LOOM_BIN");
    if (!b) GTEST_SKIP() << "LOOM_BIN is not set (run through ctest)";
    bin_ = b;
    dir_ = std::filesystem::temp_directory_path() /
           ("loom_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
            "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  // `env` (VAR=value ..., may be empty) loom `args`.
  CommandResult run(const std::string& env, const std::string& args) {
    const std::string cmd = env + " " + bin_ + " " + args + " > " + (dir_ / "out.txt").string() +
                            " 2> " + (dir_ / "err.txt").string();
    const int rc = std::system(cmd.c_str());
    return {rc, read_text(dir_ / "out.txt"), read_text(dir_ / "err.txt")};
  }
  std::string bin_;
  std::filesystem::path dir_;
};

}  // namespace loom::test
