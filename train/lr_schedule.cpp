#include "train/lr_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.hpp"
#include "train/config.hpp"

namespace loom {

DecayType decay_type_from_name(const std::string& name) {
  if (name == "cosine") return DecayType::cosine;
  if (name == "linear") return DecayType::linear;
  if (name == "wsd") return DecayType::wsd;
  if (name == "none") return DecayType::none;
  fail(
      "lr_scheduler.decay_type: expected one of \"cosine\", \"linear\", \"wsd\", \"none\", found "
      "\"",
      name, "\"");
}

LrSchedule LrSchedule::from_config(const JobConfig& c) {
  LrSchedule s;
  s.lr = c.optimizer.lr;
  s.warmup_steps = c.lr_scheduler.warmup_steps;
  s.total_steps = c.training.steps;
  s.decay = decay_type_from_name(c.lr_scheduler.decay_type);
  s.min_lr_ratio = c.lr_scheduler.min_lr_ratio;
  s.decay_ratio = c.lr_scheduler.decay_ratio;
  return s;
}

double LrSchedule::at(int64_t step) const {
  LOOM_CHECK(step >= 1, "lr schedule: steps are numbered from 1, got ", step);
  const int64_t N = std::max<int64_t>(total_steps, 1), W = std::max<int64_t>(warmup_steps, 0);
  const int64_t s = std::min(step, N);
  if (s <= W) return lr * double(s) / double(W);
  const double m = min_lr_ratio;
  switch (decay) {
    case DecayType::none:
      return lr;
    case DecayType::cosine: {
      const double p = double(s - W) / double(N - W);
      return lr * (m + (1 - m) * 0.5 * (1 + std::cos(std::numbers::pi * p)));
    }
    case DecayType::linear: {
      const double p = double(s - W) / double(N - W);
      return lr * (m + (1 - m) * (1 - p));
    }
    case DecayType::wsd: {
      const int64_t D = std::min<int64_t>(std::llround(decay_ratio * double(N)), N - W);
      if (D <= 0 || s <= N - D) return lr;
      const double q = double(s - (N - D)) / double(D);
      return lr * (m + (1 - m) * (1 - q));
    }
  }
  return lr;
}

}  // namespace loom
