// Meshes over real MPI groups: every factorization of the world size, each group checked for its
// size, its members (against an independent brute-force count), and by communicating over it.
#include <gtest/gtest.h>

#include <set>

#include "distributed/mesh.hpp"
#include "distributed/mpi_process_group.hpp"
#include "tests/distributed/mesh_util.hpp"

using namespace loom;
using namespace loom::dist;

namespace {

using Sizes = test::MeshSizes;

std::vector<Sizes> factorizations(int n) {
  return test::mesh_factorizations(n);
}

// The world ranks that share every coordinate outside dims [a, b] with world rank w, computed
// from the row-major layout directly (tp innermost).
std::vector<int> brute_members(const Sizes& s, int world, int a, int b, int w) {
  auto coords = [&](int r) {
    Sizes c{};
    for (int d = kMeshDims - 1; d >= 0; --d) c[d] = r % s[d], r /= s[d];
    return c;
  };
  std::vector<int> out;
  const Sizes cw = coords(w);
  for (int v = 0; v < world; ++v) {
    const Sizes cv = coords(v);
    bool same = true;
    for (int d = 0; d < kMeshDims; ++d) same &= (d >= a && d <= b) || cv[d] == cw[d];
    if (same) out.push_back(v);
  }
  return out;
}

std::string range_name(int a, int b) {
  std::string s;
  for (int d = a; d <= b; ++d) s += str_cat(d > a ? "," : "", kMeshDimNames[d]);
  return s;
}

// Each member contributes its world rank: the gathered list must be the expected members.
void check_by_communication(ProcessGroup& g, const std::vector<int>& expected) {
  Tensor me = Tensor::empty({1}, DType::i32);
  me.data<int32_t>()[0] = g.world_rank();
  Tensor all = Tensor::zeros({g.size()}, DType::i32);
  g.all_gather(me, all)->wait();
  std::vector<int> got(all.data<int32_t>(), all.data<int32_t>() + g.size());
  EXPECT_EQ(got, expected) << g.describe();
}

}  // namespace

TEST(MpiMesh, EveryFactorizationOfTheWorld) {
  auto world = std::shared_ptr<ProcessGroup>(make_mpi_world_group());
  world->set_timeout_seconds(20);
  const int n = world->size(), me = world->rank();
  for (const Sizes& s : factorizations(n)) {
    MeshShape shape{s[0], s[1], s[2], s[3], s[4]};
    if (s[0] == 1) shape.dp_shard = -1;  // resolves to s[2]
    Mesh mesh(shape, world);
    SCOPED_TRACE(mesh.layout().describe());
    ASSERT_EQ(mesh.layout().sizes(), s);
    for (int d = 0; d < kMeshDims; ++d) {
      const auto name = kMeshDimNames[d];
      EXPECT_EQ(mesh.size(name), s[d]);
      // The coordinate is this rank's index in its group over that dim.
      EXPECT_EQ(mesh.coord(name), mesh.group(name).rank()) << name;
    }
    EXPECT_EQ(mesh.coord("tp"), me % s[4]);
    std::set<const ProcessGroup*> checked;
    for (int a = 0; a < kMeshDims; ++a) {
      for (int b = a; b < kMeshDims; ++b) {
        const std::string dims = range_name(a, b);
        ProcessGroup& g = mesh.group(dims);
        const std::vector<int> expected = brute_members(s, n, a, b, me);
        ASSERT_EQ(g.world_ranks(), expected) << dims;
        EXPECT_EQ(g.world_ranks()[g.rank()], me);
        EXPECT_EQ(g.backend(), g.size() > 1 ? "mpi" : "single") << dims;
        // Ranges with the same ranks share a group: communicate over each group once.
        if (g.size() > 1 && checked.insert(&g).second) check_by_communication(g, expected);
      }
    }
    EXPECT_EQ(&mesh.group("dp"), &mesh.group("dp_replicate,dp_shard"));
    EXPECT_EQ(mesh.group("world").size(), n);
  }
}

TEST(MpiMesh, NamedExamplesOnEightRanks) {
  auto world = std::shared_ptr<ProcessGroup>(make_mpi_world_group());
  if (world->size() != 8) GTEST_SKIP() << "needs 8 ranks";
  const int me = world->rank();
  {
    Mesh mesh(MeshShape{1, 2, 2, 1, 2}, world);  // dp_replicate x dp_shard x tp
    EXPECT_EQ(mesh.group("tp").world_ranks(), (std::vector<int>{me & ~1, me | 1}));
    EXPECT_EQ(mesh.group("dp_shard").size(), 2);
    EXPECT_EQ(mesh.group("dp").size(), 4);
    EXPECT_EQ(mesh.group("dp").name(), "dp_replicate,dp_shard");
    EXPECT_EQ(mesh.group("dp_shard,cp").name(), "dp_shard");  // cp = 1 shares the group
    EXPECT_EQ(&mesh.group("dp_shard,cp"), &mesh.group("dp_shard"));
    // HSDP-style all-reduce over dp_replicate after a reduce-scatter over dp_shard.
    Tensor grad = Tensor::empty({4}, DType::f32);
    for (int i = 0; i < 4; ++i) grad.data<float>()[i] = float(me * 4 + i);
    Tensor shard = Tensor::zeros({2}, DType::f32);
    mesh.group("dp_shard").reduce_scatter(grad, shard, ReduceOp::sum)->wait();
    mesh.group("dp_replicate").all_reduce(shard, ReduceOp::sum)->wait();
    // Sum over the 4 dp ranks sharing my tp coordinate, block = my dp_shard coordinate.
    const auto dp = mesh.group("dp").world_ranks();
    for (int i = 0; i < 2; ++i) {
      float expected = 0;
      for (int q : dp) expected += float(q * 4 + mesh.coord("dp_shard") * 2 + i);
      EXPECT_EQ(shard.data<float>()[i], expected);
    }
  }
  {
    Mesh mesh(MeshShape{2, 1, 2, 2, 1}, world);  // pp x dp_shard x cp
    EXPECT_EQ(mesh.group("pp").world_ranks(), (std::vector<int>{me % 4, me % 4 + 4}));
    EXPECT_EQ(mesh.group("cp").world_ranks(), (std::vector<int>{me & ~1, me | 1}));
    EXPECT_EQ(mesh.group("dp_shard,cp").size(), 4);
    EXPECT_EQ(mesh.group("dp_shard,cp").world_ranks()[0], me / 4 * 4);
  }
}

TEST(MpiMesh, ShapeErrorsOnEveryRankWithoutCommunicating) {
  auto world = std::shared_ptr<ProcessGroup>(make_mpi_world_group());
  const int n = world->size();
  try {
    Mesh(MeshShape{1, 1, -1, 1, n + 1}, world);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(str_cat("world size ", n, " is not divisible")),
              std::string::npos)
        << e.what();
  }
  try {
    Mesh(MeshShape{1, 1, n, 1, 2}, world);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(str_cat("= ", 2 * n, " ranks, but the world size is ", n)),
              std::string::npos)
        << e.what();
  }
  // Still in step: a collective after the errors completes.
  world->set_timeout_seconds(20);
  world->barrier()->wait();
}
