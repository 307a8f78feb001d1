#pragma once
// The sum of one double over the ranks of a group (the step's loss over dp, a micro-batch's over
// cp), the same on every rank.
#include "distributed/process_group.hpp"

namespace loom {

// Each rank's value goes as two floats (hi + lo) and the parts are added in rank order, so every
// rank gets the same bits. nullptr or size 1: x.
double dp_sum(dist::ProcessGroup* group, double x);

}  // namespace loom
