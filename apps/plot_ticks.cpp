#include "apps/plot_ticks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace loom::plot {

std::vector<double> linear_ticks(double lo, double hi, int target) {
  if (!(hi > lo) || target < 1) return {lo};
  // The spacing among 1, 2, 5 and 10 times a power of ten whose tick count is nearest the target.
  const double mag = std::pow(10.0, std::floor(std::log10((hi - lo) / target)));
  double step = mag, best = INFINITY;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    const double count = std::floor(hi / (m * mag)) - std::ceil(lo / (m * mag)) + 1;
    if (std::abs(count - target) < best) best = std::abs(count - target), step = m * mag;
  }
  std::vector<double> t;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + 1e-9 * step; k += 1)
    t.push_back(k * step == 0 ? 0.0 : k * step);  // no "-0"
  return t;
}

std::vector<double> log_ticks(double lo, double hi) {
  const int k0 = int(std::floor(std::log10(lo))), k1 = int(std::ceil(std::log10(hi)));
  const std::vector<std::vector<double>> sets = {{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}};
  for (const auto& mults : sets) {
    std::vector<double> t;
    // Over many decades, every n-th power of ten, so the labels do not collide.
    const int stride = mults.size() == 1 ? std::max(1, (k1 - k0) / 8) : 1;
    for (int k = k0; k <= k1; ++k) {
      if (mults.size() == 1 && k % stride) continue;
      for (double m : mults) {
        const double v = m * std::pow(10.0, k);
        if (v >= lo * (1 - 1e-12) && v <= hi * (1 + 1e-12)) t.push_back(v);
      }
    }
    if (t.size() >= 3) return t;
  }
  return linear_ticks(lo, hi, 5);  // a range shorter than a factor of about 2
}

std::string tick_label(double v, double spacing) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  char b[48];
  if (a >= 1e6 || a < 1e-4) {
    std::snprintf(b, sizeof b, "%.3g", v);
    return b;
  }
  int decimals = 0;
  if (spacing > 0 && spacing < 1) decimals = int(std::ceil(-std::log10(spacing) - 1e-9));
  std::snprintf(b, sizeof b, "%.*f", std::min(decimals, 6), v);
  return b;
}

}  // namespace loom::plot
