#include "distributed/group_sum.hpp"

namespace loom {

double group_sum(dist::ProcessGroup* group, double x) {
  if (!group || group->size() == 1) return x;
  const int n = group->size();
  Tensor mine = Tensor::empty({2}, DType::f32), all = Tensor::empty({2 * n}, DType::f32);
  const float hi = float(x);
  mine.data<float>()[0] = hi;
  mine.data<float>()[1] = float(x - double(hi));
  group->all_gather(mine, all)->wait();
  double s = 0;
  for (int r = 0; r < n; ++r)
    s += double(all.data<float>()[2 * r]) + double(all.data<float>()[2 * r + 1]);
  return s;
}

}  // namespace loom
