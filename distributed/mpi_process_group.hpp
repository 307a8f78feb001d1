#pragma once
// The MPI backend: every collective is made of MPI nonblocking calls on the group's communicators.
//
// Waiting: Work::wait() polls MPI_Testall (which is also what drives the progress of nonblocking
// collectives in Open MPI: a collective left alone without test() or wait() does not advance),
// yielding the core between polls at first and then sleeping a few microseconds growing to 1 ms.
// After the group's timeout it prints one line to stderr naming the collective, the group, this
// world rank, the peers' world ranks, the bytes and the time waited, and calls
// MPI_Abort(MPI_COMM_WORLD, 1): a collective never hangs silently.
//
// reduce_scatter is point to point: each rank sends every peer its block and sums the blocks it
// receives, in the order of Open MPI's MPI_Ireduce_scatter_block (20-60x slower than this from
// 16 MB of input per rank up, docs/decisions/distributed-runtime.md). A group keeps the staging of
// finished reduce_scatters for reuse: (size - 2) x out.nbytes per reduce_scatter in flight, not
// counted by loom's allocator.
//
// Limits: at most INT_MAX elements per rank and call (MPI counts are int; all_to_all_v: in and
// out each, its displacements being int too). MPI calls are made only from the thread that drives
// the groups (MPI_THREAD_SERIALIZED is requested).
#include <functional>
#include <memory>
#include <string>

#include "distributed/process_group.hpp"

namespace loom::dist {

// True when this process was started by an MPI launcher (mpirun/mpiexec of Open MPI or MPICH,
// srun), judged from the environment the launcher sets. A task of an `srun --mpi=none` step of one
// task is not: it runs as a process of its own (Open MPI's MPI_Init fails there).
bool launched_under_mpi();

// The environment, as getenv reads it (tests pass their own).
using EnvLookup = std::function<const char*(const char*)>;

// The number of tasks of the srun step that started this process itself (SLURM_STEP_NUM_TASKS), 0
// when srun did not (a shell, mpirun's ranks inside an allocation, an sbatch script).
int srun_step_tasks(const EnvLookup& env);

// Why MPI cannot join the tasks of the srun step that started this process, "" when it can or
// when srun did not start it: srun wires tasks up through its MPI plugin (--mpi=pmix sets
// PMIX_RANK, --mpi=pmi2 PMI_RANK, --mpi=none nothing), and without one each task would come up as
// an MPI world of its own. `pmix_only`: the MPI library connects srun's tasks through PMIx alone
// (Open MPI 4.1 as Debian builds it: no PMI-1/PMI-2 component).
std::string srun_launch_problem(const EnvLookup& env, bool pmix_only);

// MPI_Init_thread on construction, MPI_Finalize on destruction. If MPI is already initialized,
// it neither initializes nor finalizes. Destroy every MPI process group before it. Under srun,
// fails before MPI_Init when srun_launch_problem names one, and after it when MPI_COMM_WORLD is
// not the step's tasks (the message says how to launch instead).
class MpiRuntime {
 public:
  MpiRuntime();  // no command line needed: Open MPI and MPICH read their settings from the env
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

 private:
  bool owns_ = false;
  int world_rank_ = 0, world_size_ = 1;
};

// This process's place in MPI_COMM_WORLD while MPI is up (initialized and not finalized);
// rank 0 of 1 otherwise.
struct WorldPlace {
  int rank = 0, size = 1;
};
WorldPlace mpi_world();

// For an error that ends this process: when MPI is up and the world has more than one rank,
// MPI_Abort(MPI_COMM_WORLD, code), which ends every rank at once and does not return. The peers
// may be waiting for this rank in a collective, and returning into MPI_Finalize instead (Open
// MPI's waits for every rank) would leave the whole job stuck until the collective timeout.
// Returns, doing nothing, on one process or when MPI is not up.
void abort_world_if_shared(int code);

// A group over all of MPI_COMM_WORLD (on a duplicated communicator). MPI must be initialized.
std::unique_ptr<ProcessGroup> make_mpi_world_group(std::string name = "world");

namespace detail {
// The bf16 sum that the MPI reduction runs: inout[i] = bf16(float(in[i]) + float(inout[i])),
// rounded to nearest even.
void bf16_sum_into(const bf16* in, bf16* inout, int64_t n);
}  // namespace detail

}  // namespace loom::dist
