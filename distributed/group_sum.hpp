#pragma once
// The sum of doubles over the ranks of a group (the step's loss over dp, a micro-batch's over
// cp, the squared gradient norm over the shard, tp and pp groups), the same bits on every rank.
#include <vector>

#include "distributed/process_group.hpp"

namespace loom {

// Collectives carry no f64, so each double travels as its 64 bits in two int32 (exact), and
// every rank adds the gathered values in rank order. nullptr or size 1: x.
double group_sum(dist::ProcessGroup* group, double x);

// Element-wise: out[i] = the sum over the ranks, in rank order, of their xs[i] (every rank passes
// the same count). A rank's exact zeros leave the others' values unchanged, so a value held by one
// rank only comes back with all its bits.
std::vector<double> group_sum_each(dist::ProcessGroup* group, const std::vector<double>& xs);

}  // namespace loom
