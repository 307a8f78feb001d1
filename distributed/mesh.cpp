#include "distributed/mesh.hpp"

#include <map>

namespace loom::dist {

namespace {

std::string sizes_str(const std::array<int, kMeshDims>& s) {
  std::string out;
  for (int i = 0; i < kMeshDims; ++i) out += str_cat(i ? " x " : "", kMeshDimNames[i], "=", s[i]);
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

std::string dim_order() {
  std::string s;
  for (int i = 0; i < kMeshDims; ++i) s += str_cat(i ? ", " : "", kMeshDimNames[i]);
  return s;
}

int world_size_of(const std::shared_ptr<ProcessGroup>& world) {
  LOOM_CHECK(world, "mesh: the world process group is null");
  return world->size();
}

}  // namespace

std::array<int, kMeshDims> MeshShape::resolve(int world_size) const {
  std::array<int, kMeshDims> s = {pp, dp_replicate, dp_shard, cp, tp};
  LOOM_CHECK(world_size >= 1, "mesh: world size ", world_size, " must be >= 1");
  for (int i = 0; i < kMeshDims; ++i) {
    if (i == 2 && s[i] == -1) continue;
    LOOM_CHECK(s[i] >= 1, "mesh: ", kMeshDimNames[i], " = ", s[i], " must be >= 1",
               i == 2 ? " (or -1 for the rest of the world)" : "");
  }
  if (s[2] == -1) {
    const int rest = pp * dp_replicate * cp * tp;
    LOOM_CHECK(world_size % rest == 0, "mesh: dp_shard = -1 cannot fill the world: world size ",
               world_size, " is not divisible by pp x dp_replicate x cp x tp = ", pp, " x ",
               dp_replicate, " x ", cp, " x ", tp, " = ", rest);
    s[2] = world_size / rest;
  }
  int64_t product = 1;
  for (int v : s) product *= v;
  LOOM_CHECK(product == world_size, "mesh: ", sizes_str(s), " = ", product,
             " ranks, but the world size is ", world_size);
  return s;
}

MeshLayout::MeshLayout(const MeshShape& shape, int world_size)
    : sizes_(shape.resolve(world_size)), world_size_(world_size) {}

int MeshLayout::dim_index(std::string_view dim) {
  for (int i = 0; i < kMeshDims; ++i) {
    if (kMeshDimNames[i] == dim) return i;
  }
  fail("mesh: unknown dim '", dim, "'; the dims are ", dim_order(), " (also 'dp' and 'world')");
}

std::string MeshLayout::describe() const {
  return str_cat(sizes_str(sizes_), " (", world_size_, " ranks)");
}

std::array<int, kMeshDims> MeshLayout::coords(int world_rank) const {
  LOOM_CHECK(world_rank >= 0 && world_rank < world_size_, "mesh: world rank ", world_rank,
             " is outside [0, ", world_size_, ")");
  std::array<int, kMeshDims> c{};
  for (int i = kMeshDims - 1; i >= 0; --i) {
    c[i] = world_rank % sizes_[i];
    world_rank /= sizes_[i];
  }
  return c;
}

int MeshLayout::world_rank_of(const std::array<int, kMeshDims>& c) const {
  int r = 0;
  for (int i = 0; i < kMeshDims; ++i) r = r * sizes_[i] + c[i];
  return r;
}

std::pair<int, int> MeshLayout::dim_range(std::string_view dims) const {
  std::vector<int> idx;
  std::string_view rest = dims;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view name = trim(rest.substr(0, comma));
    if (name == "dp") {
      idx.insert(idx.end(), {1, 2});
    } else if (name == "world") {
      for (int i = 0; i < kMeshDims; ++i) idx.push_back(i);
    } else {
      LOOM_CHECK(!name.empty(), "mesh: empty dim name in '", dims, "'");
      idx.push_back(dim_index(name));
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  for (size_t i = 1; i < idx.size(); ++i) {
    LOOM_CHECK(idx[i] > idx[i - 1], "mesh: dims '", dims,
               "' must be listed once each and in mesh order: ", dim_order());
  }
  const int first = idx.front(), last = idx.back();
  for (int d = first, k = 0; d <= last; ++d) {
    if (idx[k] == d) {
      ++k;
      continue;
    }
    LOOM_CHECK(sizes_[d] == 1, "mesh: dims '", dims, "' are not adjacent: '", kMeshDimNames[d],
               "' (size ", sizes_[d], ") lies between them in the mesh order ", dim_order());
  }
  return {first, last};
}

std::vector<int> MeshLayout::members(int first, int last, int world_rank) const {
  LOOM_CHECK(0 <= first && first <= last && last < kMeshDims, "mesh: bad dim range [", first, ", ",
             last, "]");
  std::array<int, kMeshDims> c = coords(world_rank);
  int n = 1;
  for (int d = first; d <= last; ++d) n *= sizes_[d];
  std::vector<int> out(n);
  for (int i = 0; i < n; ++i) {
    int rem = i;
    for (int d = last; d >= first; --d) {
      c[d] = rem % sizes_[d];
      rem /= sizes_[d];
    }
    out[i] = world_rank_of(c);
  }
  return out;
}

Mesh::Mesh(const MeshShape& shape, std::shared_ptr<ProcessGroup> world)
    : layout_(shape, world_size_of(world)), world_(std::move(world)) {
  coords_ = layout_.coords(world_->rank());
  // One group per distinct set of dims of size > 1; created in the same order on every rank,
  // because each split is collective over the world.
  std::map<unsigned, std::shared_ptr<ProcessGroup>> by_mask;
  for (int first = 0; first < kMeshDims; ++first) {
    for (int last = first; last < kMeshDims; ++last) {
      unsigned mask = 0;
      std::string name, nontrivial;
      for (int d = first; d <= last; ++d) {
        name += str_cat(d > first ? "," : "", kMeshDimNames[d]);
        if (layout_.sizes()[d] > 1) {
          mask |= 1u << d;
          nontrivial += str_cat(nontrivial.empty() ? "" : ",", kMeshDimNames[d]);
        }
      }
      auto& g = groups_[first][last];
      if (mask == 0) {
        g = std::make_shared<SingleProcessGroup>(name, world_->world_rank());
        continue;
      }
      auto it = by_mask.find(mask);
      if (it != by_mask.end()) {
        g = it->second;
        continue;
      }
      // color: the coordinates outside the dims; key: those inside, both row-major.
      int color = 0, key = 0, size = 1;
      for (int d = 0; d < kMeshDims; ++d) {
        const int s = layout_.sizes()[d];
        if (mask >> d & 1u) {
          key = key * s + coords_[d];
          size *= s;
        } else {
          color = color * s + coords_[d];
        }
      }
      g = world_->split_known(color, key, nontrivial, layout_.members(first, last, world_->rank()));
      LOOM_CHECK(g->size() == size && g->rank() == key, "mesh: group '", nontrivial,
                 "' came out of ", "the split with size ", g->size(), " and rank ", g->rank(),
                 ", expected ", size, " and ", key);
      by_mask[mask] = g;
    }
  }
}

ProcessGroup& Mesh::group(std::string_view dims) const {
  if (dims == "ep" || dims == "ep_shard") {
    const auto& g = dims == "ep" ? ep_group_ : ep_shard_group_;
    LOOM_CHECK(g, "mesh: group '", dims, "' asked before add_expert_groups");
    return *g;
  }
  const auto [first, last] = layout_.dim_range(dims);
  return *groups_[first][last];
}

void Mesh::add_expert_groups(int ep) {
  LOOM_CHECK(!ep_group_, "mesh: the expert groups are added once");
  ProcessGroup& fsdp = group("dp_shard,cp");
  LOOM_CHECK(ep >= 1 && fsdp.size() % ep == 0, "parallelism.ep = ", ep,
             ": expected a divisor of dp_shard x cp = ", fsdp.size(),
             " (expert parallelism borrows its ranks from the FSDP dims)");
  ep_ = ep;
  // Every rank's fsdp group has the same shape: the members come from its world ranks.
  const std::vector<int>& f = fsdp.world_ranks();
  const int r = fsdp.rank(), block = r / ep, place = r % ep;
  std::vector<int> in_block, at_place;
  for (int i = 0; i < ep; ++i) in_block.push_back(f[size_t(block * ep + i)]);
  for (int b = 0; b < fsdp.size() / ep; ++b) at_place.push_back(f[size_t(b * ep + place)]);
  // Colors unique over the world: the fsdp group's first world rank tells the groups apart.
  const int base = f.front() * 2 * (fsdp.size() + 1);
  auto make = [&](int color, int key, const char* name, const std::vector<int>& members) {
    if (members.size() == 1) {
      // Still a split on every rank of the world (collective), but a group of one is single.
      world_->split_known(color, key, name, members);
      return std::shared_ptr<ProcessGroup>(
          std::make_shared<SingleProcessGroup>(name, world_->world_rank()));
    }
    return std::shared_ptr<ProcessGroup>(world_->split_known(color, key, name, members));
  };
  ep_group_ = make(base + block, place, "ep", in_block);
  ep_shard_group_ = make(base + fsdp.size() / ep + place + 1, block, "ep_shard", at_place);
  if (ep_group_) ep_group_->set_timeout_seconds(world_->timeout_seconds());
  if (ep_shard_group_) ep_shard_group_->set_timeout_seconds(world_->timeout_seconds());
}

void Mesh::set_timeout_seconds(double seconds) {
  world_->set_timeout_seconds(seconds);
  for (auto* g : {ep_group_.get(), ep_shard_group_.get()})
    if (g) g->set_timeout_seconds(seconds);
  for (auto& row : groups_) {
    for (auto& g : row) {
      if (g) g->set_timeout_seconds(seconds);
    }
  }
}

}  // namespace loom::dist
