#include "core/read_file.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"

using namespace loom;

namespace {

std::string message_of(const std::string& path, std::string_view what) {
  try {
    (void)read_file(path, what);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ReadFile, ReturnsEveryByte) {
  const std::string path =
      (std::filesystem::temp_directory_path() / str_cat("loom_read_file_test_", ::getpid(), ".bin"))
          .string();
  const std::string bytes("a\0b\r\n\xff", 6);
  std::ofstream(path, std::ios::binary) << bytes;
  EXPECT_EQ(read_file(path), bytes);
  std::ofstream(path, std::ios::binary | std::ios::trunc).flush();
  EXPECT_EQ(read_file(path, "model config"), "");
  std::filesystem::remove(path);
}

// The message names the file and, when given, what it is.
TEST(ReadFile, AMissingFileIsAnErrorNamingIt) {
  EXPECT_EQ(message_of("/nonexistent/x.json", "model config"),
            "cannot open model config '/nonexistent/x.json'");
  EXPECT_EQ(message_of("/nonexistent/x.json", ""), "cannot open '/nonexistent/x.json'");
}
