#pragma once
// The mesh of [parallelism] as sizes, and every question asked about it: which dims are on, the
// group FSDP shards over (dp_shard x cp), what the sequence length must divide by, whether a
// layout is supported, and the process groups of a built mesh. Plain values only (the [parallelism]
// settings are passed in), so the planner and the trainer ask the same object.
#include <cstdint>
#include <string>

#include "distributed/mesh.hpp"

namespace loom {

struct ParallelDims {
  // As configured, dp_shard = -1 meaning "what the world leaves"; resolved() fills it in.
  int64_t dp_replicate = 1, dp_shard = -1, cp = 1, tp = 1, pp = 1;
  int64_t ep = 1;                 // borrowed from dp_shard x cp: adds no rank
  bool sequence_parallel = true;  // tp_sequence_parallel

  // The ranks the settings ask for (an unresolved dp_shard counts as 1).
  int64_t asked() const { return dp_replicate * (dp_shard == -1 ? 1 : dp_shard) * cp * tp * pp; }
  ParallelDims resolved(int world_size) const;  // loom::Error when the world does not fit

  // Of a resolved layout:
  int64_t world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int64_t dp() const { return dp_replicate * dp_shard; }  // the data-parallel ranks
  // FSDP shards over dp_shard x cp: every cp rank holds part of every sample, so its gradient is
  // a partial sum like a dp rank's.
  int64_t fsdp() const { return dp_shard * cp; }
  bool tp_enabled() const { return tp > 1; }
  bool cp_enabled() const { return cp > 1; }
  bool sp_enabled() const { return tp_enabled() && sequence_parallel; }
  bool fsdp_enabled() const { return fsdp() > 1; }
  bool hsdp_enabled() const { return fsdp_enabled() && dp_replicate > 1; }
  bool ddp_enabled() const { return !fsdp_enabled() && dp() > 1; }
  // Context parallelism cuts a sequence into 2*cp chunks and, with sequence parallelism, each
  // rank's rows into tp parts: seq_len must be a multiple of this (1 without cp).
  int64_t seq_divisor() const { return cp_enabled() ? 2 * cp * (sp_enabled() ? tp : 1) : 1; }
  int64_t local_seq_len(int64_t seq_len) const { return seq_len / cp; }  // a cp rank's tokens

  // What `loom train` supports, checked before any work: a multi-rank layout needs a mesh
  // (`one_process`: none will be built), and a seq_len that context parallelism splits.
  void validate(int64_t seq_len, bool one_process) const;
  // A multi-rank layout needs an MPI launch (`command` names the command in the hint).
  void check_launched(bool launched, const std::string& command) const;

  dist::MeshShape mesh_shape() const;
};

// The process groups of a mesh that the parallel model communicates on (all nullptr, rank 0 of 1
// without a mesh).
struct ParallelGroups {
  dist::ProcessGroup* dp = nullptr;         // all data-parallel ranks
  dist::ProcessGroup* shard = nullptr;      // FSDP's dp_shard (x cp) group when its size is > 1
  dist::ProcessGroup* replicate = nullptr;  // dp_replicate (HSDP, or DDP alone)
  dist::ProcessGroup* tp = nullptr;         // the tensor-parallel group when its size is > 1
  dist::ProcessGroup* cp = nullptr;         // the context-parallel group when its size is > 1
  dist::ProcessGroup* pp = nullptr;         // the pipeline-parallel group when its size is > 1
  // Expert parallelism (the mesh's add_expert_groups): the ranks the experts are split over, and
  // the experts' FSDP group (the ranks of `shard` that hold the same experts) when ep > 1.
  dist::ProcessGroup* ep = nullptr;
  dist::ProcessGroup* expert_shard = nullptr;
  int64_t rank = 0, size = 1;  // this rank's place in `dp`
};
ParallelGroups parallel_groups(dist::Mesh* mesh);

}  // namespace loom
