#pragma once
// A process group whose ranks are threads of one process (a test utility, not a backend of the
// product): run_ranks(n, fn) runs fn on n std::threads, each with its rank of one world group,
// so layers that issue collectives (tensor parallelism, FSDP's hooks) get unit tests without
// mpirun.
//
// Semantics, as the ProcessGroup rules (distributed/process_group.hpp) and MPI give them:
// - Issuing a collective copies this rank's input into the group's shared rendezvous and never
//   blocks. A Work completes only inside its wait(): test() returns whether wait() has run, so
//   when an output is written, and the log below, are a function of the program, never of thread
//   timing (product code only polls test() to drive MPI, and waits before reading).
// - Reductions add in rank order (bf16: rounded after each addition, as the MPI backend's bf16
//   op), so results are the same in every run.
// - send is buffered (it completes at once); a recv takes the messages of its (peer, tag) in the
//   order they were sent, matched to recvs in the order those were posted.
// - A wait that would never end (a rank issued another collective, or none) throws after the
//   group's timeout; when one rank's function throws, every other rank's wait throws too, and
//   run_ranks rethrows the lowest failing rank's error after joining all threads.
// - all_to_all_v checks every rank's counts against the others' (a recv_rows entry that is not
//   the sender's send_rows entry throws in wait(), naming both), which MPI cannot do cheaply.
// - split() is collective, as MPI_Comm_split (ranks of one color ordered by key, then rank).
//
// Per-thread state of the product (ops::ops_run(), the RecordWork sinks) is per rank here, as it
// would be per process; the allocator is shared and locks (core/allocator.cpp), so its peak
// statistics are those of all ranks together.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/process_group.hpp"

namespace loom::test {

// The state the ranks of one group share, and one collective in it (thread_process_group.cpp).
struct Rendezvous;
struct PostedOp;

class ThreadProcessGroup final : public dist::ProcessGroup {
 public:
  ThreadProcessGroup(std::string name, int rank, std::vector<int> world_ranks,
                     std::shared_ptr<Rendezvous> rendezvous);
  std::string_view backend() const override { return "threads"; }
  std::unique_ptr<dist::ProcessGroup> split(int color, int key, std::string name) override;

  // What this rank did on this group, in program order: "all_gather#0 issue" when a collective
  // is issued (#n counts this group's collectives), "all_gather#0 wait" when its Work is first
  // waited; send and recv likewise ("send#3 issue" ...). For tests of the order of collectives.
  const std::vector<std::string>& log() const { return log_; }
  // A line of the caller's among them (a test marks the hooks it wraps).
  void note(std::string line) { log_.push_back(std::move(line)); }
  void clear_log() { log_.clear(); }

 protected:
  std::unique_ptr<dist::Work> do_all_gather(const Tensor& in, const Tensor& out) override;
  std::unique_ptr<dist::Work> do_reduce_scatter(const Tensor& in, const Tensor& out,
                                                dist::ReduceOp op) override;
  std::unique_ptr<dist::Work> do_all_reduce(const Tensor& t, dist::ReduceOp op) override;
  std::unique_ptr<dist::Work> do_broadcast(const Tensor& t, int root) override;
  std::unique_ptr<dist::Work> do_send(const Tensor& t, int peer, int tag) override;
  std::unique_ptr<dist::Work> do_recv(const Tensor& t, int peer, int tag) override;
  std::unique_ptr<dist::Work> do_all_to_all(const Tensor& in, const Tensor& out) override;
  std::unique_ptr<dist::Work> do_all_to_all_v(const Tensor& in, std::span<const int64_t> send_rows,
                                              const Tensor& out, std::span<const int64_t> recv_rows,
                                              int64_t row_elements) override;
  std::unique_ptr<dist::Work> do_barrier() override;

 private:
  class CollectiveWork;
  class RecvWork;
  using Finish = std::function<void(PostedOp&)>;
  // Posts this rank's input bytes as the group's next collective; `finish` writes the output
  // from every rank's input when the Work completes.
  std::unique_ptr<dist::Work> post(std::string_view op, const Tensor& in, Finish finish,
                                   int root = -1);
  // The same with the bytes to post given (all_to_all_v posts its counts before its rows).
  std::unique_ptr<dist::Work> post_bytes(std::string_view op, std::vector<std::byte> in,
                                         Finish finish, int root = -1);

  std::shared_ptr<Rendezvous> rv_;
  uint64_t next_op_ = 0;  // collectives this rank has issued on this group
  uint64_t next_p2p_ = 0;
  std::vector<std::string> log_;
};

// Runs fn(group) for ranks 0..n-1 of a fresh world group named "world", each on its own thread
// (waits time out after `timeout_s`); returns after every thread has finished, rethrowing the
// error of the lowest rank that failed of its own (not because another one did).
void run_ranks(int n, const std::function<void(ThreadProcessGroup&)>& fn, double timeout_s = 60);

}  // namespace loom::test
