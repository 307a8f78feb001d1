// TensorBoard's event files: the CRC-32C and TFRecord framing against known vectors, and the
// writer's files (fresh, resumed, torn) read back through the generated messages. The files of a
// real run are checked by an independent decoder in tests/train/tensorboard.sh.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"
#include "train/run_claim.hpp"
#include "train/tensorboard_event.pb.h"
#include "train/tensorboard_writer.hpp"
#include "train/tfrecord.hpp"

namespace loom {
namespace {

using loom::test::TempDir;

namespace fs = std::filesystem;
namespace pb = loom::tensorboard;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<pb::Event> events_of(const std::string& path) {
  const TFRecords r = parse_tfrecords(read_file(path));
  EXPECT_TRUE(r.complete()) << path << ": " << r.error;
  std::vector<pb::Event> out;
  for (const std::string& rec : r.records) {
    out.emplace_back();
    EXPECT_TRUE(out.back().ParseFromString(rec)) << path;
  }
  return out;
}

// The steps of the events holding a scalar `tag`, in file order.
std::vector<int64_t> steps_with(const std::vector<pb::Event>& events, const std::string& tag) {
  std::vector<int64_t> out;
  for (const pb::Event& e : events)
    for (const auto& v : e.summary().value())
      if (v.tag() == tag) out.push_back(e.step());
  return out;
}

StepMetrics metrics_of(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.total_steps = 100;
  m.loss = 5.0 - 0.01 * double(step);
  m.lr = 1e-3;
  m.grad_norm = 0.5;
  m.tokens_per_s = 12345.5;
  m.mfu = 0.42;
  m.peak_allocated_bytes = 123456789;
  return m;
}

TEST(TFRecord, Crc32cKnownVectors) {
  // RFC 3720 (iSCSI), B.4, and the customary check value of "123456789".
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8a9136aau);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62a8ab43u);
  std::string up(32, '\0');
  for (int i = 0; i < 32; ++i) up[size_t(i)] = char(i);
  EXPECT_EQ(crc32c(up), 0x46dd794eu);
  EXPECT_EQ(masked_crc32c(""), 0xa282ead8u);
  EXPECT_EQ(masked_crc32c("123456789"), 0xc78ab0e5u);
}

TEST(TFRecord, FrameMatchesAnIndependentEncoder) {
  // Python's crc32c package framed "abc": length 3, its masked CRC, the data, the data's.
  const std::string want(
      "\x03\0\0\0\0\0\0\0\xb0\x99\x49\x0e"
      "abc\x6e\x57\xf1\x21",
      19);
  EXPECT_EQ(tfrecord_frame("abc"), want);
  const TFRecords r = parse_tfrecords(want + tfrecord_frame(""));
  ASSERT_TRUE(r.complete()) << r.error;
  ASSERT_EQ(r.records.size(), 2u);
  EXPECT_EQ(r.records[0], "abc");
  EXPECT_EQ(r.records[1], "");
}

TEST(TFRecord, StopsAtATornOrCorruptRecord) {
  const std::string a = tfrecord_frame("first"), b = tfrecord_frame("second");
  for (size_t cut = 1; cut < b.size(); ++cut) {
    const TFRecords r = parse_tfrecords(a + b.substr(0, cut));
    EXPECT_FALSE(r.complete()) << cut;
    EXPECT_EQ(r.records.size(), 1u) << cut;
    EXPECT_EQ(r.valid_bytes, a.size()) << cut;
  }
  for (size_t flip : {size_t(0), size_t(9), size_t(13), b.size() - 1}) {
    std::string bad = a + b;
    bad[a.size() + flip] ^= 0x01;
    const TFRecords r = parse_tfrecords(bad);
    EXPECT_FALSE(r.complete()) << flip;
    EXPECT_EQ(r.records.size(), 1u) << flip;
  }
  // A length near 2^64 must not wrap around the bounds check.
  std::string huge(8, '\xff');
  const uint32_t crc = masked_crc32c(huge);
  for (int i = 0; i < 4; ++i) huge += char((crc >> (8 * i)) & 0xff);
  EXPECT_FALSE(parse_tfrecords(huge + "data").complete());
}

TEST(TensorBoardWriter, FreshRunWritesVersionConfigAndSteps) {
  TempDir t;
  const std::string dir = t / "tb";
  std::string path;
  {
    TensorBoardWriter w({dir, -1, "[job]\nname = \"x\"\n"});
    path = w.path();
    for (int64_t s = 1; s <= 3; ++s) {
      StepMetrics m = metrics_of(s);
      // A mixture of experts' own metrics follow, under their metrics.jsonl names.
      if (s == 3) m.extra = {{"aux_loss", "aux", 2.25}, {"expert_load", "load", 1.5}};
      w.step(m);
    }
    w.validation(3, 4.5);
  }
  ASSERT_EQ(tensorboard_event_files(dir), std::vector<std::string>{path});
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  const std::vector<pb::Event> ev = events_of(path);
  ASSERT_EQ(ev.size(), 6u);  // version, config, 3 steps, 1 validation
  EXPECT_EQ(ev[0].file_version(), "brain.Event:2");
  EXPECT_GT(ev[0].wall_time(), 1.6e9);
  ASSERT_EQ(ev[1].summary().value_size(), 1);
  const auto& text = ev[1].summary().value(0);
  EXPECT_EQ(ev[1].step(), 0);
  EXPECT_EQ(text.tag(), "config");
  EXPECT_EQ(text.metadata().plugin_data().plugin_name(), "text");
  EXPECT_EQ(text.tensor().dtype(), pb::DT_STRING);
  EXPECT_EQ(text.tensor().tensor_shape().dim_size(), 0);
  ASSERT_EQ(text.tensor().string_val_size(), 1);
  EXPECT_EQ(text.tensor().string_val(0), "```toml\n[job]\nname = \"x\"\n```");
  const StepMetrics m = metrics_of(2);
  const auto& v = ev[3].summary();
  EXPECT_EQ(ev[3].step(), 2);
  ASSERT_EQ(v.value_size(), 6);
  const std::vector<std::pair<std::string, float>> want = {
      {"loss", float(m.loss)},
      {"lr", float(m.lr)},
      {"grad_norm", float(m.grad_norm)},
      {"tokens_per_s", float(m.tokens_per_s)},
      {"mfu", float(m.mfu)},
      {"peak_allocated_bytes", float(m.peak_allocated_bytes)}};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(v.value(i).tag(), want[size_t(i)].first);
    EXPECT_EQ(v.value(i).simple_value(), want[size_t(i)].second) << want[size_t(i)].first;
  }
  const auto& moe = ev[4].summary();
  ASSERT_EQ(moe.value_size(), 8);
  EXPECT_EQ(moe.value(6).tag(), "aux_loss");
  EXPECT_EQ(moe.value(6).simple_value(), 2.25f);
  EXPECT_EQ(moe.value(7).tag(), "expert_load");
  EXPECT_EQ(moe.value(7).simple_value(), 1.5f);
  EXPECT_EQ(ev[5].step(), 3);
  EXPECT_EQ(ev[5].summary().value(0).tag(), "val_loss");
  EXPECT_EQ(ev[5].summary().value(0).simple_value(), 4.5f);
  const TensorBoardHistory h = tensorboard_history({path});
  EXPECT_EQ(h.events, 4);  // the config text is not counted
  EXPECT_EQ(h.last_step, 3);
}

TEST(TensorBoardWriter, ResumeDropsLaterStepsAndStartsANewFile) {
  TempDir t;
  const std::string dir = t / "tb";
  std::string first;
  {
    TensorBoardWriter w({dir, -1, "a = 1\n"});
    first = w.path();
    for (int64_t s = 1; s <= 6; ++s) w.step(metrics_of(s));
    w.validation(4, 4.0);
    w.validation(6, 3.0);
  }
  // A run killed in the middle of a record.
  { std::ofstream(first, std::ios::binary | std::ios::app) << tfrecord_frame("torn").substr(0, 7); }
  std::string second;
  {
    TensorBoardWriter w({dir, 4, "a = 2\n"});  // resumed from the checkpoint of step 4
    second = w.path();
    for (int64_t s = 5; s <= 7; ++s) w.step(metrics_of(s));
  }
  ASSERT_EQ(tensorboard_event_files(dir), (std::vector<std::string>{first, second}));
  EXPECT_LT(fs::path(first).filename(), fs::path(second).filename());
  const std::vector<pb::Event> a = events_of(first), b = events_of(second);
  EXPECT_EQ(steps_with(a, "loss"), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(steps_with(a, "val_loss"), (std::vector<int64_t>{4}));
  EXPECT_EQ(a[0].file_version(), "brain.Event:2");
  ASSERT_GE(b.size(), 3u);
  EXPECT_EQ(b[0].file_version(), "brain.Event:2");
  EXPECT_EQ(b[1].session_log().status(), pb::SessionLog::START);
  EXPECT_EQ(b[1].step(), 5);
  EXPECT_EQ(b[2].step(), 5);
  EXPECT_EQ(b[2].summary().value(0).tensor().string_val(0), "```toml\na = 2\n```");
  EXPECT_EQ(steps_with(b, "loss"), (std::vector<int64_t>{5, 6, 7}));
  // Nothing is left over from the rewrite.
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file();
  EXPECT_EQ(n, 2u);
  // A fresh run with overwrite removes both.
  {
    TensorBoardWriter w({dir, -1, ""});
    EXPECT_EQ(tensorboard_event_files(dir), std::vector<std::string>{w.path()});
  }
}

TEST(TensorBoardClaim, FreshRunRefusesAnotherRunsEvents) {
  TempDir t;
  const std::string dir = t / "tb";
  check_tensorboard_dir_writable(dir);
  EXPECT_TRUE(fs::is_directory(dir));
  EXPECT_NO_THROW(check_tensorboard_dir_free(dir, false));
  {
    TensorBoardWriter w({dir, -1, "x = 1\n"});
    // A file version and a config text are no history yet; a step is.
    EXPECT_NO_THROW(check_tensorboard_dir_free(dir, false));
    w.step(metrics_of(1));
    w.step(metrics_of(2));
  }
  try {
    check_tensorboard_dir_free(dir, false);
    ADD_FAILURE() << "not refused";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("metrics.tensorboard '" + dir + "' already holds 2 events"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("(up to step 2)"), std::string::npos) << what;
    EXPECT_NE(what.find("--metrics.overwrite=true"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(check_tensorboard_dir_free(dir, true));
  // Under a regular file not even root can make a directory.
  std::ofstream(t / "file") << "x";
  try {
    check_tensorboard_dir_writable(t / "file/tb");
    ADD_FAILURE() << "not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.tensorboard '" + (t / "file/tb") +
                                         "' cannot be created"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(check_tensorboard_dir_writable(t / "file"), Error);
  EXPECT_NO_THROW(check_tensorboard_dir_writable(""));
}

// The cost the writer adds to a step (docs/decisions/trainer-and-checkpoints.md, TensorBoard): one
// event of six scalars, serialized, framed, written and flushed; and a resume's rewrite of the
// earlier file. Printed; the bounds only catch a gross regression.
TEST(TensorBoardWriter, CostPerStep) {
  TempDir t;
  const int n = 20000;
  using Clock = std::chrono::steady_clock;
  auto us_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  };
  std::string path;
  {
    TensorBoardWriter w({t / "tb", -1, ""});
    path = w.path();
    const auto t0 = Clock::now();
    for (int s = 1; s <= n; ++s) w.step(metrics_of(s));
    const double us = us_since(t0) / n;
    std::printf("TensorBoard writer: %.2f us per step (%d steps, %lld bytes)\n", us, n,
                (long long)fs::file_size(path));
    EXPECT_LT(us, 1000.0);
  }
  const auto t0 = Clock::now();
  TensorBoardWriter resumed({t / "tb", n / 2, ""});
  const double ms = us_since(t0) / 1000;
  std::printf("TensorBoard writer: a resume from step %d rewrote the %d-step file in %.1f ms\n",
              n / 2, n, ms);
  EXPECT_EQ(tensorboard_history({path}).last_step, n / 2);
  EXPECT_LT(ms, 10000.0);
}

}  // namespace
}  // namespace loom
