#include "distributed/group_sum.hpp"

#include <cstring>

namespace loom {

std::vector<double> group_sum_each(dist::ProcessGroup* group, const std::vector<double>& xs) {
  if (!group || group->size() == 1) return xs;
  const int n = group->size();
  const int64_t k = int64_t(xs.size());
  if (k == 0) return xs;
  static_assert(sizeof(double) == 2 * sizeof(int32_t));
  Tensor mine = Tensor::empty({2 * k}, DType::i32), all = Tensor::empty({2 * k * n}, DType::i32);
  std::memcpy(mine.data<int32_t>(), xs.data(), xs.size() * sizeof(double));
  group->all_gather(mine, all)->wait();
  std::vector<double> out(xs.size(), 0.0), part(xs.size());
  for (int r = 0; r < n; ++r) {
    std::memcpy(part.data(), all.data<int32_t>() + 2 * k * r, part.size() * sizeof(double));
    for (size_t i = 0; i < out.size(); ++i) out[i] += part[i];
  }
  return out;
}

double group_sum(dist::ProcessGroup* group, double x) {
  return group_sum_each(group, {x})[0];
}

}  // namespace loom
