// Mesh layout arithmetic for every world size 1..8 and every factorization, dim-list parsing, and
// errors. The same layout under MPI (real groups) is tested by distributed_mpi_test.
#include <gtest/gtest.h>

#include <algorithm>

#include "distributed/mesh.hpp"
#include "tests/distributed/mesh_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using namespace loom::dist;

namespace {

using Sizes = test::MeshSizes;

std::vector<Sizes> factorizations(int n) {
  return test::mesh_factorizations(n);
}

MeshShape shape_of(const Sizes& s) {
  return MeshShape{s[0], s[1], s[2], s[3], s[4]};
}

using loom::test::expect_error;

}  // namespace

TEST(MeshLayout, FactorizationCountsAreRight) {
  // Ordered factorizations into 5 factors: 8 = 2^3 gives C(3+4, 4) = 35, a prime gives 5, 6 = 2*3
  // gives 5 * 5 = 25.
  EXPECT_EQ(factorizations(1).size(), 1u);
  EXPECT_EQ(factorizations(7).size(), 5u);
  EXPECT_EQ(factorizations(6).size(), 25u);
  EXPECT_EQ(factorizations(8).size(), 35u);
}

TEST(MeshLayout, EveryFactorizationOfOneToEightRanks) {
  for (int n = 1; n <= 8; ++n) {
    for (const Sizes& s : factorizations(n)) {
      SCOPED_TRACE(MeshLayout(shape_of(s), n).describe());
      MeshShape rest = shape_of(s);
      rest.dp_shard = -1;
      MeshLayout L(shape_of(s), n);
      EXPECT_EQ(rest.resolve(n), s);  // -1 takes exactly what is left
      EXPECT_EQ(L.sizes(), s);
      std::vector<Sizes> coords(n);
      for (int w = 0; w < n; ++w) {
        coords[w] = L.coords(w);
        EXPECT_EQ(L.world_rank_of(coords[w]), w);
        EXPECT_EQ(coords[w][4], w % s[4]);  // tp innermost: consecutive ranks share a tp group
        for (int d = 0; d < kMeshDims; ++d) EXPECT_LT(coords[w][d], s[d]);
      }
      for (int w = 0; w < n; ++w) {
        for (int a = 0; a < kMeshDims; ++a) {
          for (int b = a; b < kMeshDims; ++b) {
            // Brute force: the ranks that agree with w on every dim outside [a, b].
            std::vector<int> expected;
            for (int v = 0; v < n; ++v) {
              bool same = true;
              for (int d = 0; d < kMeshDims; ++d) {
                if ((d < a || d > b) && coords[v][d] != coords[w][d]) same = false;
              }
              if (same) expected.push_back(v);
            }
            const std::vector<int> m = L.members(a, b, w);
            ASSERT_EQ(m, expected) << "w=" << w << " dims [" << a << ", " << b << "]";
            // Group order is the row-major order of the coordinates inside the range.
            for (size_t k = 1; k < m.size(); ++k) {
              const Sizes &p = coords[m[k - 1]], &q = coords[m[k]];
              EXPECT_TRUE(std::lexicographical_compare(p.begin() + a, p.begin() + b + 1,
                                                       q.begin() + a, q.begin() + b + 1));
            }
          }
        }
      }
    }
  }
}

TEST(MeshLayout, NamedGroupsOfTheDesignExamples) {
  // 8 = dp_replicate 2 x dp_shard 2 x tp 2.
  MeshLayout L(MeshShape{1, 2, 2, 1, 2}, 8);
  EXPECT_EQ(L.members(4, 4, 5), (std::vector<int>{4, 5}));        // tp
  EXPECT_EQ(L.members(2, 2, 5), (std::vector<int>{5, 7}));        // dp_shard
  EXPECT_EQ(L.members(1, 1, 5), (std::vector<int>{1, 5}));        // dp_replicate
  EXPECT_EQ(L.members(1, 2, 5), (std::vector<int>{1, 3, 5, 7}));  // dp
  EXPECT_EQ(L.dim_range("dp"), std::make_pair(1, 2));
  EXPECT_EQ(L.dim_range("dp_replicate, dp_shard"), std::make_pair(1, 2));
  EXPECT_EQ(L.dim_range("world"), std::make_pair(0, 4));
  EXPECT_EQ(L.dim_range("dp_shard,tp"), std::make_pair(2, 4));  // cp = 1 may be skipped
  EXPECT_EQ(L.dim_range("dp,tp"), std::make_pair(1, 4));
  // 8 = pp 2 x dp_shard 2 x cp 2.
  MeshLayout M(MeshShape{2, 1, 2, 2, 1}, 8);
  EXPECT_EQ(M.members(3, 3, 6), (std::vector<int>{6, 7}));        // cp
  EXPECT_EQ(M.members(2, 3, 6), (std::vector<int>{4, 5, 6, 7}));  // dp_shard,cp
  EXPECT_EQ(M.members(0, 0, 6), (std::vector<int>{2, 6}));        // pp
  expect_error([&] { M.dim_range("dp_shard,tp"); }, {"not adjacent", "'cp' (size 2)"});
  expect_error([&] { M.dim_range("pp,cp"); }, {"not adjacent", "'dp_shard' (size 2)"});
  expect_error([&] { M.dim_range("cp,dp_shard"); }, {"mesh order"});
  expect_error([&] { M.dim_range("dp,dp_shard"); }, {"mesh order"});
  expect_error([&] { M.dim_range("sp"); }, {"unknown dim 'sp'", "pp, dp_replicate"});
  expect_error([&] { M.dim_range("tp,"); }, {"empty dim name"});
}

TEST(MeshShape, ErrorsNameTheSizesAndTheWorld) {
  expect_error(
      [] {
        MeshShape{1, 1, 3, 1, 2}.resolve(8);
      },
      {"pp=1 x dp_replicate=1 x dp_shard=3 x cp=1 x tp=2 = 6 ranks", "world size is 8"});
  expect_error(
      [] {
        MeshShape{1, 1, -1, 3, 1}.resolve(8);
      },
      {"dp_shard = -1", "world size 8 is not divisible", "= 3"});
  expect_error([] { MeshShape{1, 1, -1, 1, 0}.resolve(8); }, {"tp = 0 must be >= 1"});
  expect_error([] { MeshShape{1, 1, -2, 1, 1}.resolve(8); }, {"dp_shard = -2", "or -1"});
  expect_error([] { MeshShape{}.resolve(0); }, {"world size 0"});
  EXPECT_EQ(MeshShape{}.resolve(6), (Sizes{1, 1, 6, 1, 1}));
  EXPECT_EQ((MeshShape{2, 1, -1, 1, 2}.resolve(8)), (Sizes{2, 1, 2, 1, 2}));
}

TEST(Mesh, SingleProcessEveryGroupIsTheSingleGroup) {
  Mesh mesh(MeshShape{}, std::make_shared<SingleProcessGroup>());
  EXPECT_EQ(mesh.world_size(), 1);
  for (const char* dims :
       {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard,cp", "world", "pp,tp"}) {
    ProcessGroup& g = mesh.group(dims);
    EXPECT_EQ(g.size(), 1) << dims;
    EXPECT_EQ(g.backend(), "single");
    EXPECT_EQ(g.world_ranks(), std::vector<int>{0});
  }
  EXPECT_EQ(mesh.group("dp_shard,cp").name(), "dp_shard,cp");
  EXPECT_EQ(mesh.coord("tp"), 0);
  mesh.set_timeout_seconds(2);
  EXPECT_EQ(mesh.group("tp").timeout_seconds(), 2);
  expect_error(
      [] {
        Mesh(MeshShape{1, 1, 1, 1, 2}, std::make_shared<SingleProcessGroup>());
      },
      {"tp=2 = 2 ranks", "world size is 1"});
  expect_error([] { Mesh(MeshShape{}, nullptr); }, {"null"});
}
