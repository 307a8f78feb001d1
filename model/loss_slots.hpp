#pragma once
// The micro-batches' losses where the head computes them: one float64 slot each on the run's
// device, written by the fused loss op and read back together, so that a GPU waits for the
// step's losses once (at the end of the step, or of a pipeline round) instead of once per
// micro-batch. The slots live in chunks of kChunk, allocated when first needed and kept (the
// meta run books them as the real run does); clear() frees the slots for the next step.
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.hpp"

namespace loom {

// A micro-batch's loss not yet read: its slot (-1: none, this rank has no head) and a part the
// host added (MoE's auxiliary loss). Its value is slot + extra.
struct PendingLoss {
  int64_t slot = -1;
  double extra = 0;
};

class LossSlots {
 public:
  static constexpr int64_t kChunk = 64;
  explicit LossSlots(Device device) : device_(device) {}

  // A fresh slot and its float64 [1] view on the device.
  int64_t take();
  Tensor slot(int64_t i) const;
  // The values of `pending` (slot + extra; extra alone without a slot), with one copy per chunk
  // in use; 0 on meta, where nothing is computed.
  std::vector<double> read(std::span<const PendingLoss> pending) const;
  double read(const PendingLoss& p) const { return read(std::span(&p, 1))[0]; }
  // Slots taken from now on start again at 0 (call only when no loss is pending).
  void clear() { taken_ = 0; }

 private:
  Device device_;
  std::vector<Tensor> chunks_;  // float64 [kChunk] each
  int64_t taken_ = 0;
};

}  // namespace loom
