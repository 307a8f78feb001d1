// The micro-batches' loss slots: written on the device, read back together in any order asked.
#include "model/loss_slots.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "core/error.hpp"
#include "tests/test_util.hpp"

namespace loom {
namespace {

TEST(LossSlots, ReadManyAtOnceInTheOrderAsked) {
  LossSlots slots(Device::cpu);
  // More than one chunk: slot 70 lives in the second.
  std::vector<int64_t> taken;
  for (int i = 0; i < 71; ++i) {
    taken.push_back(slots.take());
    slots.slot(taken.back()).data<double>()[0] = 1.5 * i + 0.25;
  }
  EXPECT_EQ(taken.front(), 0);
  EXPECT_EQ(taken.back(), 70);
  const std::vector<PendingLoss> ask{{70, 0.0}, {3, 1.0}, {-1, 2.5}, {0, 0.0}};
  const std::vector<double> got = slots.read(ask);
  EXPECT_EQ(got, (std::vector<double>{1.5 * 70 + 0.25, 1.5 * 3 + 0.25 + 1.0, 2.5, 0.25}));
  EXPECT_EQ(slots.read(PendingLoss{5, 0.0}), 1.5 * 5 + 0.25);
  // A slot not taken is refused; after clear() the slots are taken from 0 again, the chunks kept.
  test::expect_error([&] { slots.read(PendingLoss{71, 0.0}); }, {"loss slot 71 was not taken"});
  slots.clear();
  EXPECT_EQ(slots.take(), 0);
  test::expect_error([&] { (void)slots.slot(1); }, {"loss slot 1 was not taken (1 taken)"});
}

// A rank without the head (a pipeline's first stage) reads only host parts: no chunk exists.
TEST(LossSlots, NothingTakenReadsTheHostParts) {
  const LossSlots slots(Device::cpu);
  EXPECT_EQ(slots.read(std::vector<PendingLoss>{}), std::vector<double>{});
  EXPECT_EQ(slots.read(std::vector<PendingLoss>{{-1, 0.0}, {-1, 1.5}}),
            (std::vector<double>{0.0, 1.5}));
}

TEST(LossSlots, MetaBooksTheChunksAndReadsZero) {
  LossSlots slots(Device::meta);
  const int64_t i = slots.take();
  EXPECT_EQ(slots.slot(i).device(), Device::meta);
  EXPECT_EQ(slots.slot(i).dtype(), DType::f64);
  EXPECT_EQ(slots.read(PendingLoss{i, 0.5}), 0.5);
}

}  // namespace
}  // namespace loom
