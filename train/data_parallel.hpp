#pragma once
// The data-parallel setup that `loom train` (the Trainer) and `loom bench step` share, so the
// benchmark measures exactly the layout the trainer runs: MPI and the mesh of [parallelism], the
// data-parallel groups, the (sharded) model with its FSDP/HSDP or DDP hooks, one micro-batch's
// forward/backward with the hooks' bookkeeping, and the reductions of a step.
#include <cstdint>
#include <memory>
#include <string>

#include "core/dtype.hpp"
#include "distributed/mesh.hpp"
#include "distributed/mpi_process_group.hpp"
#include "model/llama.hpp"
#include "parallel/ddp.hpp"
#include "parallel/fsdp.hpp"
#include "train/config.hpp"

namespace loom {

// MPI (when launched by an MPI launcher) and the mesh of [parallelism] (when the world has more
// than one rank). Member order matters: MPI is finalized after every group is gone.
struct DistRuntime {
  std::unique_ptr<dist::MpiRuntime> mpi;
  std::unique_ptr<dist::Mesh> mesh;  // nullptr: one process
};
// loom::Error on every rank when the world does not fit [parallelism], or when the config asks
// for several ranks and this process was not started by an MPI launcher (`command` names the
// command in that message, e.g. "train").
DistRuntime start_distributed(const JobConfig& job, const std::string& command);

// The data-parallel groups of a mesh (all nullptr, rank 0 of 1 without one).
struct DpGroups {
  dist::ProcessGroup* dp = nullptr;         // all data-parallel ranks
  dist::ProcessGroup* shard = nullptr;      // FSDP's dp_shard (x cp) group when its size is > 1
  dist::ProcessGroup* replicate = nullptr;  // dp_replicate (HSDP, or DDP alone)
  dist::ProcessGroup* tp = nullptr;         // the tensor-parallel group when its size is > 1
  dist::ProcessGroup* cp = nullptr;         // the context-parallel group when its size is > 1
  int64_t rank = 0, size = 1;               // this rank's place in `dp`
};
DpGroups dp_groups(dist::Mesh* mesh);

// The model of one rank with its data-parallel hooks: FSDP when dp_shard > 1 (HSDP when
// dp_replicate > 1 too), DDP when only dp_replicate > 1, nothing on one process.
struct DpModel {
  DpGroups groups;
  std::unique_ptr<LlamaModel> model;  // declared first: the hooks detach from it on destruction
  std::unique_ptr<parallel::Fsdp> fsdp;
  std::unique_ptr<parallel::Ddp> ddp;

  // One micro-batch (`last`: the last of the step, the one DDP reduces on); returns the summed
  // loss of this rank's tokens.
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale, bool last);
  // After the step's last micro-batch, before clipping: every gradient reduction complete.
  void finish_step();
  // "FSDP", "HSDP", "DDP" or "single".
  const char* kind() const;
};
// The model is allocated (sharded over groups.shard) but not initialized.
DpModel make_dp_model(const LlamaConfig& mc, DType compute, const JobConfig& job,
                      const DpGroups& groups);

// The sum over the ranks of `group` of a double, the same on every rank: each rank's value goes
// as two floats (hi + lo) and the parts are added in rank order. nullptr or size 1: x.
double dp_sum(dist::ProcessGroup* group, double x);

}  // namespace loom
