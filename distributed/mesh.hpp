#pragma once
// The device mesh: world ranks laid out on named dims, in the order pp, dp_replicate, dp_shard,
// cp, tp, row-major with tp innermost (consecutive world ranks share a tp group, so tp stays
// inside a node):
//   world = (((pp_i * dp_replicate + dpr_i) * dp_shard + dps_i) * cp + cp_i) * tp + tp_i
//
// group("tp") holds the ranks that differ only in their tp coordinate; a comma list of dims that
// are adjacent in this order, e.g. group("dp_shard,cp"), flattens them (group rank = the
// row-major index of the listed coordinates). "dp" stands for "dp_replicate,dp_shard" and "world"
// for all dims. Dims of size 1 may be skipped in a list ("dp_shard,tp" when cp = 1).
//
// Every group is created when the mesh is built (collectively, on every rank), so asking for one
// later never communicates. Ranges of dims with the same ranks share one ProcessGroup, named by
// its dims of size > 1 (so with cp = 1, group("dp_shard,cp").name() is "dp_shard"); groups of
// size 1 are single-process groups named as asked.
#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/process_group.hpp"

namespace loom::dist {

inline constexpr int kMeshDims = 5;
inline constexpr std::array<std::string_view, kMeshDims> kMeshDimNames = {"pp", "dp_replicate",
                                                                          "dp_shard", "cp", "tp"};

// Sizes as configured; dp_shard = -1 takes what the world leaves.
struct MeshShape {
  int pp = 1, dp_replicate = 1, dp_shard = -1, cp = 1, tp = 1;

  // The sizes in mesh order with dp_shard resolved; loom::Error when they do not fit the world.
  std::array<int, kMeshDims> resolve(int world_size) const;
};

// The pure arithmetic of the layout, shared by Mesh and usable without any process group.
class MeshLayout {
 public:
  MeshLayout(const MeshShape& shape, int world_size);

  const std::array<int, kMeshDims>& sizes() const { return sizes_; }
  int world_size() const { return world_size_; }
  int size(std::string_view dim) const { return sizes_[dim_index(dim)]; }
  // The coordinates of a world rank, in mesh order.
  std::array<int, kMeshDims> coords(int world_rank) const;
  int world_rank_of(const std::array<int, kMeshDims>& coords) const;

  // A list of dims ("dp_shard,cp", "dp", "world"...) as the range [first, last] of mesh dims;
  // loom::Error for unknown or non-adjacent dims.
  std::pair<int, int> dim_range(std::string_view dims) const;
  // The world ranks of the group over dims [first, last] that contains world_rank, in group order.
  std::vector<int> members(int first, int last, int world_rank) const;

  static int dim_index(std::string_view dim);  // loom::Error for an unknown name
  std::string describe() const;                // "pp=1 x dp_replicate=2 x ... (8 ranks)"

 private:
  std::array<int, kMeshDims> sizes_;
  int world_size_;
};

class Mesh {
 public:
  // Collective over `world` (every rank calls it with the same shape). world.size() is the world.
  Mesh(const MeshShape& shape, std::shared_ptr<ProcessGroup> world);

  const MeshLayout& layout() const { return layout_; }
  int world_rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  int size(std::string_view dim) const { return layout_.size(dim); }
  int coord(std::string_view dim) const { return coords_[MeshLayout::dim_index(dim)]; }

  ProcessGroup& group(std::string_view dims) const;
  ProcessGroup& world() const { return *world_; }

  // Expert parallelism (a mixture of experts' experts split over `ep` ranks borrowed from the
  // FSDP dims, as torchtitan does): group("ep") holds consecutive blocks of `ep` ranks of
  // group("dp_shard,cp") (so the all-to-alls stay between neighbours), group("ep_shard") the
  // ranks of that group at the same place in their blocks (the experts' FSDP group). ep must
  // divide dp_shard x cp. Collective over the world, once; without it (or with ep = 1) both are
  // this rank alone.
  void add_expert_groups(int ep);
  int ep() const { return ep_; }

  // Applies to every group of the mesh, the world included.
  void set_timeout_seconds(double seconds);

 private:
  MeshLayout layout_;
  std::shared_ptr<ProcessGroup> world_;
  std::array<int, kMeshDims> coords_;
  // groups_[first][last]: the group over dims [first, last].
  std::array<std::array<std::shared_ptr<ProcessGroup>, kMeshDims>, kMeshDims> groups_;
  int ep_ = 1;
  std::shared_ptr<ProcessGroup> ep_group_, ep_shard_group_;
};

}  // namespace loom::dist
