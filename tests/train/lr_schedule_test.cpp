#include "train/lr_schedule.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.hpp"
#include "train/config.hpp"

using loom::DecayType;
using loom::LrSchedule;

namespace {

LrSchedule make(DecayType d, int64_t warmup, int64_t total, double min_ratio = 0.1,
                double decay_ratio = 0.2, double lr = 2.0) {
  LrSchedule s;
  s.lr = lr;
  s.warmup_steps = warmup;
  s.total_steps = total;
  s.decay = d;
  s.min_lr_ratio = min_ratio;
  s.decay_ratio = decay_ratio;
  return s;
}

// The values below are computed by hand from the formulas in lr_schedule.hpp (lr = 2, W = 10,
// N = 110, m = 0.1, so after warmup p = (s - 10) / 100); a tolerance of 1e-12 only absorbs the
// rounding of cos.
constexpr double kTol = 1e-12;

}  // namespace

TEST(LrSchedule, WarmupIsLinearFromLrOverWToLr) {
  for (DecayType d : {DecayType::cosine, DecayType::linear, DecayType::wsd, DecayType::none}) {
    const LrSchedule s = make(d, 10, 110);
    EXPECT_NEAR(s.at(1), 0.2, kTol);
    EXPECT_NEAR(s.at(5), 1.0, kTol);
    EXPECT_NEAR(s.at(10), 2.0, kTol);
  }
}

TEST(LrSchedule, Cosine) {
  const LrSchedule s = make(DecayType::cosine, 10, 110);
  EXPECT_NEAR(s.at(11), 2.0 * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.01))), kTol);
  EXPECT_NEAR(s.at(35), 2.0 * (0.1 + 0.9 * 0.5 * (1 + std::sqrt(0.5))), kTol);  // p = 1/4
  EXPECT_NEAR(s.at(60), 2.0 * 0.55, kTol);                                      // p = 1/2
  EXPECT_NEAR(s.at(85), 2.0 * (0.1 + 0.9 * 0.5 * (1 - std::sqrt(0.5))), kTol);  // p = 3/4
  EXPECT_NEAR(s.at(110), 0.2, kTol);  // the last step runs at lr * min_lr_ratio
  EXPECT_NEAR(s.at(500), 0.2, kTol);  // clamped past the end
  for (int64_t t = 11; t <= 110; ++t) EXPECT_LE(s.at(t), s.at(t - 1)) << t;
}

TEST(LrSchedule, Linear) {
  const LrSchedule s = make(DecayType::linear, 10, 110);
  EXPECT_NEAR(s.at(11), 2.0 * (0.1 + 0.9 * 0.99), kTol);
  EXPECT_NEAR(s.at(35), 2.0 * (0.1 + 0.9 * 0.75), kTol);
  EXPECT_NEAR(s.at(60), 2.0 * 0.55, kTol);
  EXPECT_NEAR(s.at(110), 0.2, kTol);
}

TEST(LrSchedule, WarmupStableDecay) {
  // D = round(0.2 * 110) = 22 decay steps: constant through step 88, then linear to 0.2 at 110.
  const LrSchedule s = make(DecayType::wsd, 10, 110);
  EXPECT_NEAR(s.at(11), 2.0, kTol);
  EXPECT_NEAR(s.at(50), 2.0, kTol);
  EXPECT_NEAR(s.at(88), 2.0, kTol);
  EXPECT_NEAR(s.at(89), 2.0 * (0.1 + 0.9 * (1 - 1.0 / 22)), kTol);
  EXPECT_NEAR(s.at(99), 2.0 * 0.55, kTol);
  EXPECT_NEAR(s.at(110), 0.2, kTol);
  // The decay never reaches into the warmup: D = min(round(0.9 * 20), 20 - 10) = 10.
  const LrSchedule t = make(DecayType::wsd, 10, 20, 0.0, 0.9);
  EXPECT_NEAR(t.at(10), 2.0, kTol);
  EXPECT_NEAR(t.at(15), 2.0 * 0.5, kTol);
  EXPECT_NEAR(t.at(20), 0.0, kTol);
  // decay_ratio 0: no decay at all.
  const LrSchedule u = make(DecayType::wsd, 0, 20, 0.1, 0.0);
  EXPECT_NEAR(u.at(20), 2.0, kTol);
}

TEST(LrSchedule, NoneAndNoWarmup) {
  const LrSchedule n = make(DecayType::none, 10, 110);
  EXPECT_NEAR(n.at(11), 2.0, kTol);
  EXPECT_NEAR(n.at(110), 2.0, kTol);
  // Without warmup the decay starts at step 1: p = 1/N.
  const LrSchedule c = make(DecayType::cosine, 0, 4, 0.0);
  EXPECT_NEAR(c.at(1), 2.0 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), kTol);
  EXPECT_NEAR(c.at(2), 1.0, kTol);
  EXPECT_NEAR(c.at(4), 0.0, kTol);
  // Warmup covering every step: the rate only rises.
  const LrSchedule w = make(DecayType::cosine, 8, 4);
  EXPECT_NEAR(w.at(4), 1.0, kTol);
}

TEST(LrSchedule, FromConfigAndErrors) {
  const loom::JobConfig c = loom::parse_job_config(
      "[optimizer]\nlr = 0.5\n[training]\nsteps = 40\n[lr_scheduler]\nwarmup_steps = 4\n"
      "decay_type = \"linear\"\nmin_lr_ratio = 0.2\ndecay_ratio = 0.3\n",
      "job.toml");
  const LrSchedule s = LrSchedule::from_config(c);
  EXPECT_EQ(s.lr, 0.5);
  EXPECT_EQ(s.warmup_steps, 4);
  EXPECT_EQ(s.total_steps, 40);
  EXPECT_EQ(s.decay, DecayType::linear);
  EXPECT_EQ(s.min_lr_ratio, 0.2);
  EXPECT_EQ(s.decay_ratio, 0.3);
  EXPECT_NEAR(s.at(22), 0.5 * (0.2 + 0.8 * 0.5), kTol);
  EXPECT_THROW(s.at(0), loom::Error);
  EXPECT_THROW(loom::decay_type_from_name("step"), loom::Error);
}
