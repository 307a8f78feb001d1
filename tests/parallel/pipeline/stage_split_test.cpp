// The stage split: contiguous unit ranges covering every unit once, the embedding on the first
// stage and the head on the last, every stage with a block; balanced by default (embedding and
// head weighted as a layer), explicit with pp_stage_layers; bad splits refused naming the key.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "parallel/pipeline/stage_split.hpp"

namespace loom::pp {
namespace {

void expect_cover(const std::vector<UnitRange>& r, int L, const std::string& what) {
  ASSERT_FALSE(r.empty()) << what;
  EXPECT_EQ(r.front().first, 0u) << what;
  EXPECT_EQ(r.back().second, size_t(L + 2)) << what;
  for (size_t s = 0; s < r.size(); ++s) {
    if (s) {
      EXPECT_EQ(r[s].first, r[s - 1].second) << what;
    }
    // Blocks are units 1..L: every stage holds at least one.
    const size_t blocks_lo = std::max<size_t>(r[s].first, 1);
    const size_t blocks_hi = std::min<size_t>(r[s].second, size_t(L + 1));
    EXPECT_GT(blocks_hi, blocks_lo) << what << " stage " << s;
  }
}

TEST(PipelineStageSplit, BalancedCoversEveryUnit) {
  for (int L = 1; L <= 12; ++L)
    for (int S = 1; S <= L; ++S) {
      const auto r = stage_units(L, S);
      expect_cover(r, L, str_cat("L=", L, " S=", S));
      ASSERT_EQ(r.size(), size_t(S));
    }
  // 8 blocks + embedding + head over 2 stages: 5 units each, so 4 blocks beside each end unit.
  EXPECT_EQ(stage_units(8, 2), (std::vector<UnitRange>{{0, 5}, {5, 10}}));
  // 6 blocks over 4 stages: 8 units, 2 each: the end stages get one block, the middle two.
  EXPECT_EQ(stage_units(6, 4), (std::vector<UnitRange>{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
}

TEST(PipelineStageSplit, Explicit) {
  EXPECT_EQ(stage_units(5, 3, parse_stage_layers("1, 3,1")),
            (std::vector<UnitRange>{{0, 2}, {2, 5}, {5, 7}}));
  auto err = [](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(err([] {
              stage_units(5, 3, {2, 2});
            }).find("pp_stage_layers has 2 entries"),
            std::string::npos);
  EXPECT_NE(err([] { stage_units(5, 2, {2, 2}); }).find("sums to 4"), std::string::npos);
  EXPECT_NE(err([] { parse_stage_layers("2,0"); }).find("\"0\" is not a positive integer"),
            std::string::npos);
  EXPECT_NE(err([] { parse_stage_layers("2,,3"); }).find("pp_stage_layers"), std::string::npos);
  EXPECT_NE(err([] { stage_units(3, 4); }).find("at least one layer per stage"), std::string::npos);
}

// A mixture of experts' sparse layer is two blocks (attention, experts): the layers' split in
// the model's units keeps both on one stage.
TEST(PipelineStageSplit, LayersOfTwoBlocksStayTogether) {
  // Layer 0 dense, 1 and 2 sparse: units embed 0, layer 0 = 1, layer 1 = 2-3, layer 2 = 4-5,
  // head 6.
  EXPECT_EQ(layer_ranges_to_blocks(stage_units(3, 2), {1, 2, 2}),
            (std::vector<UnitRange>{{0, 4}, {4, 7}}));
  EXPECT_EQ(layer_ranges_to_blocks(stage_units(4, 4), {1, 2, 2, 2}),
            (std::vector<UnitRange>{{0, 2}, {2, 4}, {4, 6}, {6, 9}}));
  // One block per layer: the same ranges.
  EXPECT_EQ(layer_ranges_to_blocks(stage_units(6, 4), {1, 1, 1, 1, 1, 1}), stage_units(6, 4));
  EXPECT_THROW(layer_ranges_to_blocks(stage_units(3, 2), {1, 2}), Error);
}

}  // namespace
}  // namespace loom::pp
