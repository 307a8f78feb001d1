#include "distributed/sim_process_group.hpp"

#include <cstring>

#include "core/error.hpp"

namespace loom::dist {

namespace {

// Moves nothing. Like a real backend's Work it holds its tensors until it completes; the callers
// that free buffers while a step runs (FSDP, the pipeline executor) complete their Works at
// points of the program they choose, waiting there, so no peak depends on this rule. It decides
// which waits the time model counts as blocking: a collective completes at a test once a kernel
// has run since it was issued (the ranks issue it together; it needs the time of some work, and
// a test right after the issue finds it still running), a point-to-point transfer at its first
// test; a wait() before that is logged as a blocking wait.
class SimWork final : public Work {
 public:
  SimWork(std::vector<Tensor> held, SimLog& log, bool point_to_point)
      : held_(std::move(held)),
        log_(log),
        call_(log.calls.size() - 1),
        issued_at_(log.kernels),
        point_to_point_(point_to_point) {}
  void wait() override {
    // A wait that blocks: the time model makes the rank wait for the call here.
    if (!done_ && !log_.calls.empty()) log_.waits.push_back({call_, log_.kernels});
    complete();
  }
  bool test() override {
    if (done_) return true;
    if (point_to_point_ || log_.kernels > issued_at_) complete();
    return done_;
  }

 private:
  void complete() { done_ = true, held_.clear(); }

  std::vector<Tensor> held_;
  SimLog& log_;
  size_t call_;  // its index in log_.calls
  uint64_t issued_at_;
  bool point_to_point_;
  bool done_ = false;
};

// out's blocks (out.nbytes() / in.nbytes() of them) each take in's bytes.
void replicate(const Tensor& in, const Tensor& out) {
  if (!holds_data(in.device()) || !holds_data(out.device()) || in.nbytes() == 0) return;
  const auto* src = static_cast<const char*>(in.raw());
  auto* dst = static_cast<char*>(out.raw());
  for (size_t off = 0; off + in.nbytes() <= out.nbytes(); off += in.nbytes())
    if (dst + off != src) std::memmove(dst + off, src, in.nbytes());
}

std::unique_ptr<Work> done(SimLog& log, std::vector<Tensor> held = {},
                           bool point_to_point = false) {
  return std::make_unique<SimWork>(std::move(held), log, point_to_point);
}

}  // namespace

SimProcessGroup::SimProcessGroup(std::string name, int rank, std::vector<int> world_ranks,
                                 std::shared_ptr<SimLog> log)
    : ProcessGroup(std::move(name), rank, std::move(world_ranks)), log_(std::move(log)) {
  LOOM_CHECK(log_ != nullptr, "simulated ", describe(), " needs a log");
}

std::unique_ptr<ProcessGroup> SimProcessGroup::split(int, int, std::string name) {
  fail("split of simulated ", describe(), " into '", name,
       "': a simulated rank cannot ask the others for their colors; use split_known");
}

std::unique_ptr<ProcessGroup> SimProcessGroup::split_known(int color, int key, std::string name,
                                                           const std::vector<int>& members) {
  LOOM_CHECK(color >= 0, "split of ", describe(), ": color ", color, " must be non-negative");
  LOOM_CHECK(key >= 0 && key < int(members.size()) && members[size_t(key)] == world_rank(),
             "split of ", describe(), " into '", name, "': key ", key,
             " does not place world rank ", world_rank(), " among the ", members.size(),
             " members");
  return std::make_unique<SimProcessGroup>(std::move(name), key, members, log_);
}

void SimProcessGroup::on_issue(std::string_view op, uint64_t bytes_sent) {
  log_->calls.push_back({this, op, bytes_sent, log_->kernels});
}

std::unique_ptr<Work> SimProcessGroup::do_all_gather(const Tensor& in, const Tensor& out) {
  replicate(in, out);
  return done(*log_, {in, out});
}

std::unique_ptr<Work> SimProcessGroup::do_reduce_scatter(const Tensor& in, const Tensor& out,
                                                         ReduceOp) {
  if (holds_data(in.device()) && holds_data(out.device()) && out.nbytes() > 0)
    std::memcpy(out.raw(), static_cast<const char*>(in.raw()) + rank() * out.nbytes(),
                out.nbytes());
  return done(*log_, {in, out});
}

std::unique_ptr<Work> SimProcessGroup::do_all_reduce(const Tensor& t, ReduceOp) {
  return done(*log_, {t});
}

std::unique_ptr<Work> SimProcessGroup::do_broadcast(const Tensor& t, int) {
  return done(*log_, {t});
}

std::unique_ptr<Work> SimProcessGroup::do_send(const Tensor& t, int, int) {
  // The pipeline's executor frees its sends at tests of its own choosing (waiting on them there).
  return done(*log_, {t}, /*point_to_point=*/true);
}

std::unique_ptr<Work> SimProcessGroup::do_recv(const Tensor& t, int, int) {
  // What the peer would send is unknown here: zeros rather than stale bytes.
  if (holds_data(t.device()) && t.nbytes() > 0) std::memset(t.raw(), 0, t.nbytes());
  return done(*log_, {t}, /*point_to_point=*/true);
}

std::unique_ptr<Work> SimProcessGroup::do_all_to_all(const Tensor& in, const Tensor& out) {
  replicate(in.view({in.numel()}).narrow(0, 0, in.numel() / size()), out);
  return done(*log_, {in, out});
}

std::unique_ptr<Work> SimProcessGroup::do_all_to_all_v(const Tensor& in,
                                                       std::span<const int64_t> send_rows,
                                                       const Tensor& out,
                                                       std::span<const int64_t> recv_rows,
                                                       int64_t row_elements) {
  // The rows this rank sends itself are known; the others' are not: zeros, as a recv.
  if (holds_data(in.device()) && holds_data(out.device()) && out.nbytes() > 0) {
    std::memset(out.raw(), 0, out.nbytes());
    const size_t row = size_t(row_elements) * dtype_size(in.dtype());
    size_t from = 0, to = 0;
    for (int q = 0; q < rank(); ++q) {
      from += size_t(send_rows[size_t(q)]) * row;
      to += size_t(recv_rows[size_t(q)]) * row;
    }
    const size_t own = size_t(send_rows[size_t(rank())]) * row;
    if (own > 0)
      std::memcpy(static_cast<char*>(out.raw()) + to, static_cast<const char*>(in.raw()) + from,
                  own);
  }
  return done(*log_, {in, out});
}

std::unique_ptr<Work> SimProcessGroup::do_barrier() {
  return done(*log_);
}

}  // namespace loom::dist
