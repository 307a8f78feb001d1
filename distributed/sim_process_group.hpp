#pragma once
// The planner's process group (`loom plan`): one rank of an N-rank job, run alone. Every
// collective and point-to-point transfer completes at once and moves nothing; the group records
// it (op, bytes by ProcessGroup's convention) in a log shared by the run's groups, so the plan
// reports the bytes the real run would send, group by group, and the time model prices each call.
//
// The step's small host-side reductions (the loss, the gradient norm's squared sums) see their own
// value in every block, as if every rank held the same: they stay finite, so the step takes the
// path a healthy run takes (the plan says so). all_to_all_v on such tensors keeps the rows a rank
// sends itself and zeroes those from the others. Meta tensors are not touched.
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/process_group.hpp"

namespace loom::dist {

// One issued call, in issue order.
struct SimCall {
  const ProcessGroup* group = nullptr;  // the issuing group (its name, size, members)
  std::string_view op;                  // "all_gather", "send"...
  uint64_t bytes_sent = 0;
  uint64_t kernels = 0;  // SimLog::kernels when issued: the kernels that ran before it
};

// A blocking wait on call `call` (one that no test had found complete), after `kernels` kernels.
struct SimWait {
  size_t call = 0;
  uint64_t kernels = 0;
};

struct SimLog {
  std::vector<SimCall> calls;
  std::vector<SimWait> waits;
  // The kernels run so far (the planner counts them): a collective needs time, so a test finds it
  // complete only once some kernel ran after it was issued.
  uint64_t kernels = 0;
};

class SimProcessGroup final : public ProcessGroup {
 public:
  // `rank` of `world_ranks`; `log` is shared by the groups split from this one.
  SimProcessGroup(std::string name, int rank, std::vector<int> world_ranks,
                  std::shared_ptr<SimLog> log);
  std::string_view backend() const override { return "sim"; }
  bool accepts(Device d) const override { return d != Device::elsewhere; }
  // Needs the members: only split_known() works without communication.
  std::unique_ptr<ProcessGroup> split(int color, int key, std::string name) override;
  std::unique_ptr<ProcessGroup> split_known(int color, int key, std::string name,
                                            const std::vector<int>& members) override;
  const std::shared_ptr<SimLog>& log() const { return log_; }

 protected:
  void on_issue(std::string_view op, uint64_t bytes_sent) override;
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
  std::shared_ptr<SimLog> log_;
};

}  // namespace loom::dist
