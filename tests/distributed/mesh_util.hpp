#pragma once
// Mesh shapes for the mesh tests (single-process and under MPI).
#include <array>
#include <vector>

#include "distributed/mesh.hpp"

namespace loom::test {

using MeshSizes = std::array<int, dist::kMeshDims>;

// Every ordered way to write n as pp * dp_replicate * dp_shard * cp * tp.
inline std::vector<MeshSizes> mesh_factorizations(int n) {
  std::vector<MeshSizes> out;
  MeshSizes cur{};
  auto rec = [&](auto&& self, int rest, int dim) -> void {
    if (dim == dist::kMeshDims - 1) {
      cur[dim] = rest;
      out.push_back(cur);
      return;
    }
    for (int f = 1; f <= rest; ++f) {
      if (rest % f) continue;
      cur[dim] = f;
      self(self, rest / f, dim + 1);
    }
  };
  rec(rec, n, 0);
  return out;
}

}  // namespace loom::test
