#include "parallel/parallel_dims.hpp"

#include "core/error.hpp"
#include "parallel/layers/context_parallel.hpp"

namespace loom {

ParallelDims ParallelDims::resolved(int world_size) const {
  ParallelDims d = *this;
  const auto sizes = mesh_shape().resolve(world_size);
  d.pp = sizes[0];
  d.dp_replicate = sizes[1];
  d.dp_shard = sizes[2];
  d.cp = sizes[3];
  d.tp = sizes[4];
  return d;
}

void ParallelDims::validate(int64_t seq_len, bool one_process) const {
  if (one_process) {
    const int64_t world = asked();
    LOOM_CHECK(world == 1, "parallelism: dp_replicate=", dp_replicate, " dp_shard=", dp_shard,
               " tp=", tp, " cp=", cp, " pp=", pp, " needs ", world,
               " ranks, but this is one process (launch with `mpirun -np ", world,
               " loom train ...`)");
  }

  // (An unresolved dp_shard is checked when the mesh adds the expert groups.)
  LOOM_CHECK(ep == 1 || (!one_process && (dp_shard == -1 || fsdp() % ep == 0)),
             "parallelism.ep = ", ep,
             ": expected a divisor of dp_shard x cp = ", one_process ? 1 : fsdp(),
             " (expert parallelism borrows its ranks from the FSDP dims)");
  // Refused here, before any work, when seq_len does not split (the kernel's own message; the
  // check is cp_positions').
  if (cp > 1) cp_positions(seq_len, cp, 0, tp > 1 && sequence_parallel ? tp : 1);
}

void ParallelDims::check_launched(bool launched, const std::string& command) const {
  const int64_t n = asked();
  LOOM_CHECK(launched || n == 1, "parallelism asks for ", n, " ranks (dp_replicate=", dp_replicate,
             " dp_shard=", dp_shard, " tp=", tp, " cp=", cp, " pp=", pp,
             ") but this process was not started by an MPI launcher: run `mpirun -np ", n, " loom ",
             command, " ...` (or srun)");
}

dist::MeshShape ParallelDims::mesh_shape() const {
  dist::MeshShape shape;
  shape.pp = int(pp);
  shape.dp_replicate = int(dp_replicate);
  shape.dp_shard = int(dp_shard);
  shape.cp = int(cp);
  shape.tp = int(tp);
  return shape;
}

ParallelGroups parallel_groups(dist::Mesh* mesh) {
  ParallelGroups g;
  if (!mesh) return g;
  g.dp = &mesh->group("dp");
  g.rank = g.dp->rank();
  g.size = g.dp->size();
  // With cp, FSDP shards and the gradients reduce over dp_shard x cp (ParallelDims::fsdp).
  if (mesh->size("cp") > 1) g.cp = &mesh->group("cp");
  if (mesh->size("dp_shard") * mesh->size("cp") > 1)
    g.shard = &mesh->group(mesh->size("cp") > 1 ? "dp_shard,cp" : "dp_shard");
  g.replicate = &mesh->group("dp_replicate");
  if (mesh->size("tp") > 1) g.tp = &mesh->group("tp");
  if (mesh->size("pp") > 1) g.pp = &mesh->group("pp");
  if (mesh->ep() > 1) {
    g.ep = &mesh->group("ep");
    g.expert_shard = &mesh->group("ep_shard");
  }
  return g;
}

}  // namespace loom
