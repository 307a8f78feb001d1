#pragma once
// A ProcessGroup is a set of ranks that run collectives together (one mesh dim, or several
// flattened). Every collective is asynchronous: it returns a Work handle, and its output is valid
// only after Work::wait() (or Work::test() returning true).
//
// Rules shared by all backends:
// - Tensors are contiguous, of dtype f32, bf16 or i32; the output has the input's dtype.
// - The tensors' storage is kept alive by the Work until it completes, but the caller must not
//   read an output or write an input before the Work completes.
// - A ProcessGroup is driven from one thread, and must outlive the Works it returned.
// - Every rank of the group issues the same collectives in the same order.
// - Bad arguments (sizes, dtypes, ranks) throw loom::Error naming the collective and the group.
//
// Counters (per group) use this convention for `bytes_sent`: the traffic one rank sends in a
// ring algorithm, which is what the meta run of a step records and the tests' cost oracle derives
// (n = size of the group; the MPI library may pick another algorithm, this figure does not follow
// it; integer division rounds down):
//   all_gather(in, out)          (n - 1) * in.nbytes
//   reduce_scatter(in, out, op)  (n - 1) * out.nbytes
//   all_reduce(t, op)            2 * (n - 1) * t.nbytes / n
//   broadcast(t, root)           t.nbytes on the root, 0 elsewhere (tree/pipeline not counted)
//   send(t, peer, tag)           t.nbytes            recv: 0
//   all_to_all(in, out)          (n - 1) * in.nbytes / n
//   all_to_all_v(in, send_rows, out, recv_rows)
//                                the rows sent to the other ranks: sum over peers p != this rank
//                                of send_rows[p] * row bytes (a row to itself is not counted)
//   barrier()                    0
// `calls` counts issued collectives, `wait_seconds` the time spent inside Work::wait().
// A group of size 1 counts calls and waits but never bytes.
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.hpp"

namespace loom::dist {

// avg divides the sum by the group size after the reduction, in the tensor's dtype (bf16: the
// bf16 sum converted to float, divided, rounded to nearest even). int32 supports sum only.
enum class ReduceOp : uint8_t { sum, avg };
std::string_view reduce_op_name(ReduceOp op);

struct CommCounters {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;
  double wait_seconds = 0;
};

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective is complete (or aborts the job on timeout, see the backend).
  virtual void wait() = 0;
  // Drives progress once; true when complete (the output is then valid, as after wait()).
  virtual bool test() = 0;
  // What the wait is for, in the caller's words (a pipeline action): added to the timeout line.
  void set_context(std::string context) { context_ = std::move(context); }
  const std::string& context() const { return context_; }

 private:
  std::string context_;
};

// The default wait limit before a rank declares the job hung and aborts it.
inline constexpr double kDefaultTimeoutSeconds = 300;

class ProcessGroup {
 public:
  ProcessGroup(std::string name, int rank, std::vector<int> world_ranks);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  // World rank of each member, indexed by group rank.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  int world_rank() const { return world_ranks_[rank_]; }
  virtual std::string_view backend() const = 0;
  // "group 'tp' (size 4, world ranks [4, 5, 6, 7])", for messages.
  std::string describe() const;

  // How long Work::wait() waits before aborting the job (backends that can hang).
  double timeout_seconds() const { return timeout_s_; }
  void set_timeout_seconds(double seconds);

  // out = the ranks' `in` concatenated in rank order; out.numel() == size * in.numel().
  // `in` may be this rank's block of `out` (in-place all-gather).
  std::unique_ptr<Work> all_gather(const Tensor& in, const Tensor& out);
  // in.numel() == size * out.numel(); rank r receives the reduction of every rank's r-th block.
  std::unique_ptr<Work> reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op);
  // In place.
  std::unique_ptr<Work> all_reduce(const Tensor& t, ReduceOp op);
  std::unique_ptr<Work> broadcast(const Tensor& t, int root);
  // Point to point, peers are group ranks; a recv matches the send with the same (peer, tag).
  std::unique_ptr<Work> send(const Tensor& t, int peer, int tag);
  std::unique_ptr<Work> recv(const Tensor& t, int peer, int tag);
  // Equal blocks: block j of `in` goes to rank j, block i of `out` comes from rank i.
  std::unique_ptr<Work> all_to_all(const Tensor& in, const Tensor& out);
  // Rows of different counts to and from each rank (expert parallelism's token exchange). Rows
  // are along dim 0; a row's width W is the product of the other dims (1 for a 1-d tensor), the
  // same for in and out (and on every rank). `in` [sum(send_rows), W] holds the rows for rank 0,
  // then those for rank 1, ...; `out` [sum(recv_rows), W] receives rank 0's rows for this rank,
  // then rank 1's, ... Both spans have size() entries, none negative; they are read at the call
  // (the Work keeps its own copies). recv_rows[i] must equal rank i's send_rows[this rank]: the
  // caller exchanges the counts first (all_to_all of one int32 per rank). Checked here only for
  // this rank's own entry; the MPI backend cannot see a mismatch with another rank without a
  // message of its own, so the counts are the caller's contract: when more rows arrive than
  // recv_rows announces, Open MPI aborts the job (MPI_ERR_TRUNCATE); when fewer, the rest of the
  // block keeps its old contents, silently.
  std::unique_ptr<Work> all_to_all_v(const Tensor& in, std::span<const int64_t> send_rows,
                                     const Tensor& out, std::span<const int64_t> recv_rows);
  std::unique_ptr<Work> barrier();

  // Collective over this group: ranks with the same color form a new group, ordered by key (then
  // by rank here). Every rank must call it.
  virtual std::unique_ptr<ProcessGroup> split(int color, int key, std::string name) = 0;
  // The same split where every rank already knows the new group's members (world ranks in group
  // order; the mesh computes them): a backend that cannot communicate (the planner's simulated
  // one) builds the group from them, the others split collectively as above.
  virtual std::unique_ptr<ProcessGroup> split_known(int color, int key, std::string name,
                                                    const std::vector<int>& members);

  // Whether this backend takes tensors on `d`: those that move data need memory behind them;
  // the single-process and simulated groups also take meta tensors (and move nothing).
  virtual bool accepts(Device d) const { return holds_data(d); }

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = CommCounters{}; }

 protected:
  // Arguments are already checked and counted when these run.
  virtual std::unique_ptr<Work> do_all_gather(const Tensor& in, const Tensor& out) = 0;
  virtual std::unique_ptr<Work> do_reduce_scatter(const Tensor& in, const Tensor& out,
                                                  ReduceOp op) = 0;
  virtual std::unique_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) = 0;
  virtual std::unique_ptr<Work> do_broadcast(const Tensor& t, int root) = 0;
  virtual std::unique_ptr<Work> do_send(const Tensor& t, int peer, int tag) = 0;
  virtual std::unique_ptr<Work> do_recv(const Tensor& t, int peer, int tag) = 0;
  virtual std::unique_ptr<Work> do_all_to_all(const Tensor& in, const Tensor& out) = 0;
  // `row_elements`: W, the elements of one row.
  virtual std::unique_ptr<Work> do_all_to_all_v(const Tensor& in,
                                                std::span<const int64_t> send_rows,
                                                const Tensor& out,
                                                std::span<const int64_t> recv_rows,
                                                int64_t row_elements) = 0;
  virtual std::unique_ptr<Work> do_barrier() = 0;

  // Backends' Works report the time they spent in wait() here.
  void add_wait_seconds(double s) { counters_.wait_seconds += s; }
  // Every issued collective as counted (op: "all_gather", "send"...; bytes by the convention
  // above, 0 in a group of one): a backend that records the step's traffic hooks in here.
  virtual void on_issue(std::string_view op, uint64_t bytes_sent) {
    (void)op;
    (void)bytes_sent;
  }

 private:
  void count(std::string_view op, uint64_t bytes_sent);

  std::string name_;
  int rank_;
  std::vector<int> world_ranks_;
  double timeout_s_ = kDefaultTimeoutSeconds;
  CommCounters counters_;
};

// The one-process group: collectives are copies or nothing, with the same checks and counters.
// send/recv to itself is supported (a send is matched with the recv of the same tag).
class SingleProcessGroup final : public ProcessGroup {
 public:
  explicit SingleProcessGroup(std::string name = "world", int world_rank = 0);
  std::string_view backend() const override { return "single"; }
  std::unique_ptr<ProcessGroup> split(int color, int key, std::string name) override;
  bool accepts(Device d) const override { return d != Device::elsewhere; }

 protected:
  std::unique_ptr<Work> do_all_gather(const Tensor& in, const Tensor& out) override;
  std::unique_ptr<Work> do_reduce_scatter(const Tensor& in, const Tensor& out,
                                          ReduceOp op) override;
  std::unique_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) override;
  std::unique_ptr<Work> do_broadcast(const Tensor& t, int root) override;
  std::unique_ptr<Work> do_send(const Tensor& t, int peer, int tag) override;
  std::unique_ptr<Work> do_recv(const Tensor& t, int peer, int tag) override;
  std::unique_ptr<Work> do_all_to_all(const Tensor& in, const Tensor& out) override;
  std::unique_ptr<Work> do_all_to_all_v(const Tensor& in, std::span<const int64_t> send_rows,
                                        const Tensor& out, std::span<const int64_t> recv_rows,
                                        int64_t row_elements) override;
  std::unique_ptr<Work> do_barrier() override;

 private:
  struct PendingRecv;
  // Per tag, in order: sends to self not yet received (copies), receives posted before their send.
  std::map<int, std::deque<Tensor>> unmatched_sends_;
  std::map<int, std::deque<std::shared_ptr<PendingRecv>>> pending_recvs_;
};

// Element-wise x /= n for the avg reduction, in the tensor's dtype.
void divide_inplace(const Tensor& t, int n);

}  // namespace loom::dist
