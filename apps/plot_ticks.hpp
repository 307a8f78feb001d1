#pragma once
// The tick values of `loom plot`'s axes and their labels: round numbers, as people read axes.
#include <string>
#include <vector>

namespace loom::plot {

// About `target` round values (1, 2 or 5 times a power of ten apart) in [lo, hi]; for a log
// axis, powers of ten (with 2 and 5, or 2..9, between them when the range is short).
std::vector<double> linear_ticks(double lo, double hi, int target);
std::vector<double> log_ticks(double lo, double hi);
// A tick label with as many decimals as the spacing of the ticks needs.
std::string tick_label(double v, double spacing);

}  // namespace loom::plot
