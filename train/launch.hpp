#pragma once
// The start of a multi-process job that `loom train` and `loom bench step` share: MPI, the ranks'
// agreement on one configuration and binary, and the mesh of [parallelism]; and the job config's
// parallel settings as the values parallelize() takes.
#include <cstdint>
#include <memory>
#include <string>

#include "distributed/mesh.hpp"
#include "distributed/mpi_process_group.hpp"
#include "parallel/parallel_dims.hpp"
#include "parallel/parallelize.hpp"
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
// With training.device = "cuda", first checks that a GPU is usable and starts GPU local_rank().
DistRuntime start_distributed(const JobConfig& job, const std::string& command);
// The rank's index on its node: Open MPI's, Slurm's or torchrun's variable, 0 without any.
int local_rank();

// [parallelism] and [activation_checkpoint] as the parallel layer's values (parallel/ does not
// read the job config).
ParallelDims parallel_dims(const JobConfig& job);  // dp_shard as configured (-1: resolved later)
ParallelizeOptions parallelize_options(const JobConfig& job);
// The micro-batches one run of the pipeline schedule takes (1 without pp): pp_microbatches, the
// CSV schedule's, or pp x the stages per rank. A step runs the schedule grad_accum_steps times.
int64_t pipeline_microbatches(const JobConfig& job);
// The model config.json at `path` (resolve_model_config) with the job's [moe] options on it
// (MoeConfig::training; moe.bias_update_rate > 0 gives the model its selection-only bias); a key
// of [moe] off its default is an error for a model without experts.
ModelConfig job_model_config(const JobConfig& job, const std::string& path);

}  // namespace loom
