#pragma once
// The learning-rate schedule: linear warmup, then a decay to lr * min_lr_ratio.
//
// Steps are numbered from 1 (the step being taken; step s is the s-th optimizer update). With
// L = lr, W = warmup_steps, N = total steps, m = min_lr_ratio:
//
//   warmup (s <= W):      lr(s) = L * s / W                (L/W at step 1, L at step W; never 0)
//   after warmup, with p = (s - W) / (N - W) in (0, 1]     (p = 1 at the last step):
//     cosine:             lr(s) = L * (m + (1 - m) * (1 + cos(pi * p)) / 2)
//     linear:             lr(s) = L * (m + (1 - m) * (1 - p))
//     none:               lr(s) = L
//     wsd (warmup-stable-decay): D = min(round(decay_ratio * N), N - W) decay steps at the end;
//                         lr(s) = L                                  for s <= N - D
//                         lr(s) = L * (m + (1 - m) * (1 - q)),  q = (s - (N - D)) / D
//                         (D = 0: the rate stays L)
//
// So the last step of a decaying schedule runs at exactly L * m. Steps past N are clamped to N.
#include <cstdint>
#include <string>

namespace loom {

struct JobConfig;

enum class DecayType { cosine, linear, wsd, none };
DecayType decay_type_from_name(const std::string& name);  // error lists the names

struct LrSchedule {
  double lr = 3e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  DecayType decay = DecayType::cosine;
  double min_lr_ratio = 0.1;
  double decay_ratio = 0.1;  // wsd only

  static LrSchedule from_config(const JobConfig& c);  // [optimizer] lr, [lr_scheduler], steps
  double at(int64_t step) const;                      // step >= 1
};

}  // namespace loom
