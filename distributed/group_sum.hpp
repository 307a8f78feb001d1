#pragma once
// The sum of one double over the ranks of a group (the step's loss over dp, a micro-batch's over
// cp, the squared gradient norm over the shard and tp groups), the same bits on every rank.
#include "distributed/process_group.hpp"

namespace loom {

// Collectives carry no f64, so each rank's value goes as two floats (hi + lo, about 48 bits) and
// every rank adds the gathered parts in rank order. nullptr or size 1: x.
double group_sum(dist::ProcessGroup* group, double x);

}  // namespace loom
