#include "model/loss_slots.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace loom {

int64_t LossSlots::take() {
  if (taken_ == int64_t(chunks_.size()) * kChunk)
    chunks_.push_back(Tensor::empty({kChunk}, DType::f64, device_));
  return taken_++;
}

Tensor LossSlots::slot(int64_t i) const {
  LOOM_CHECK(i >= 0 && i < taken_, "loss slot ", i, " was not taken (", taken_, " taken)");
  return chunks_[size_t(i / kChunk)].narrow(0, i % kChunk, 1);
}

std::vector<double> LossSlots::read(std::span<const PendingLoss> pending) const {
  int64_t most = -1;
  for (const PendingLoss& p : pending) {
    LOOM_CHECK(p.slot < taken_, "loss slot ", p.slot, " was not taken (", taken_, " taken)");
    most = std::max(most, p.slot);
  }
  // One host copy of each chunk that holds a pending slot (on the CPU, the chunk itself).
  std::vector<Tensor> host(chunks_.size());
  const bool data = holds_data(device_);
  if (data && most >= 0)
    for (int64_t c = 0; c <= most / kChunk; ++c) host[size_t(c)] = chunks_[size_t(c)].on_host();
  std::vector<double> out;
  out.reserve(pending.size());
  for (const PendingLoss& p : pending) {
    const double v =
        p.slot < 0 || !data ? 0.0 : host[size_t(p.slot / kChunk)].data<double>()[p.slot % kChunk];
    out.push_back(v + p.extra);
  }
  return out;
}

}  // namespace loom
