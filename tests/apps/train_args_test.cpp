// `loom train`'s own flags (not config keys): --peak-seconds S and --peak-seconds=S, a bad or
// missing value an error naming the flag before anything is loaded.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "tests/apps/loom_command_test.hpp"

namespace {

class TrainArgs : public loom::test::LoomCommandTest {
 protected:
  std::string config() const {
    const char* src = std::getenv("LOOM_SOURCE_DIR");
    return std::string(src ? src : ".") + "/configs/debug.toml";
  }
};

TEST_F(TrainArgs, PeakSecondsIsAFlagOfTrain) {
  for (const std::string flag : {"--peak-seconds 0", "--peak-seconds=0.5"}) {
    const auto r = run("", "train --config " + config() + " " + flag + " --print-config");
    EXPECT_EQ(r.rc, 0) << flag << ": " << r.err;
    EXPECT_NE(r.out.find("[training]"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("peak"), std::string::npos) << "not a config key: " << r.out;
  }
}

TEST_F(TrainArgs, BadPeakSecondsIsAnError) {
  auto r = run("", "train --config " + config() + " --peak-seconds abc");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--peak-seconds: expected a non-negative number, found 'abc'"),
            std::string::npos)
      << r.err;
  r = run("", "train --config " + config() + " --peak-seconds=-1");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("found '-1'"), std::string::npos) << r.err;
  r = run("", "train --config " + config() + " --peak-seconds");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--peak-seconds needs a number"), std::string::npos) << r.err;
}

}  // namespace
