// core/trace: spans are recorded only while a recorder is installed, with wall and thread CPU
// time, and written as Chrome trace events.
#include "core/trace.hpp"

#include <gtest/gtest.h>

#include <string>

namespace {

using namespace loom;

TEST(Trace, SpansRecordWallAndCpuTimeOnlyWhenInstalled) {
  { trace::Span off("action", "not recorded"); }
  trace::Recorder rec(3);
  trace::set_recorder(&rec);
  {
    trace::Span s("action", "0F1");
    s.arg("stage", 0).arg("kind", std::string("F"));
    volatile double x = 0;
    for (int i = 0; i < 2000000; ++i) x = x + 1.0 / (i + 1);  // some CPU time
  }
  trace::Span ended("step", "step 1");
  ended.end();
  ended.end();  // a second end adds nothing
  trace::set_recorder(nullptr);
  { trace::Span off("action", "not recorded either"); }

  ASSERT_EQ(rec.events().size(), 2u);
  const trace::Event& e = rec.events()[0];
  EXPECT_EQ(e.name, "0F1");
  EXPECT_EQ(e.cat, "action");
  EXPECT_GT(e.dur_us, 0);
  EXPECT_GT(e.cpu_us, 0);
  EXPECT_LE(e.cpu_us, e.dur_us * 1.05 + 50);  // one thread cannot use more CPU than wall time
  EXPECT_GE(rec.events()[1].ts_us, e.ts_us + e.dur_us);
  const std::string j = rec.json();
  EXPECT_NE(j.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(j.find("\"name\": \"0F1\", \"cat\": \"action\", \"ph\": \"X\", \"pid\": 3"),
            std::string::npos)
      << j;
  EXPECT_NE(j.find("\"stage\": 0, \"kind\": \"F\"}"), std::string::npos) << j;
  EXPECT_EQ(j.find("not recorded"), std::string::npos);
}

}  // namespace
