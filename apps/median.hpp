#pragma once
// The median of timings (`loom bench step`'s steps, `loom bench attention`'s calls): the middle
// value, or the mean of the two middle values of an even count; 0 for none.
#include <algorithm>
#include <vector>

namespace loom {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace loom
