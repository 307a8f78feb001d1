#include "distributed/process_group.hpp"

#include <cstring>

namespace loom::dist {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
  }
  return "?";
}

ProcessGroup::ProcessGroup(std::string name, int rank, std::vector<int> world_ranks)
    : name_(std::move(name)), rank_(rank), world_ranks_(std::move(world_ranks)) {
  LOOM_CHECK(!world_ranks_.empty(), "process group '", name_, "' has no members");
  LOOM_CHECK(rank_ >= 0 && rank_ < size(), "process group '", name_, "': rank ", rank_,
             " is outside [0, ", size(), ")");
}

std::string ProcessGroup::describe() const {
  std::string s = str_cat("group '", name_, "' (size ", size(), ", world ranks [");
  for (int i = 0; i < size(); ++i) s += str_cat(i ? ", " : "", world_ranks_[i]);
  return s + "])";
}

void ProcessGroup::set_timeout_seconds(double seconds) {
  LOOM_CHECK(seconds > 0, "timeout of ", describe(), " must be positive, got ", seconds, " s");
  timeout_s_ = seconds;
}

void ProcessGroup::count(std::string_view op, uint64_t bytes_sent) {
  if (size() == 1) bytes_sent = 0;
  counters_.calls += 1;
  counters_.bytes_sent += bytes_sent;
  on_issue(op, bytes_sent);
}

std::unique_ptr<ProcessGroup> ProcessGroup::split_known(int color, int key, std::string name,
                                                        const std::vector<int>&) {
  return split(color, key, std::move(name));
}

namespace {

std::string tensor_str(const Tensor& t) {
  return str_cat(dtype_name(t.dtype()), shape_str(t.shape()));
}

void check_tensor(const ProcessGroup& g, const char* op, const char* what, const Tensor& t) {
  LOOM_CHECK(t.defined(), op, " on ", g.describe(), ": ", what, " is an undefined tensor");
  LOOM_CHECK(g.accepts(t.device()), op, " on ", g.describe(), ": ", what, " ", tensor_str(t),
             " is on the ", device_name(t.device()), " device, which the ", g.backend(),
             " backend cannot communicate");
  LOOM_CHECK(t.is_contiguous(), op, " on ", g.describe(), ": ", what, " ", tensor_str(t),
             " is not contiguous");
  const DType d = t.dtype();
  LOOM_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::i32, op, " on ", g.describe(), ": ",
             what, " has dtype ", dtype_name(d), ", expected float32, bfloat16 or int32");
}

void check_same_dtype(const ProcessGroup& g, const char* op, const Tensor& in, const Tensor& out) {
  LOOM_CHECK(in.dtype() == out.dtype(), op, " on ", g.describe(), ": in is ", tensor_str(in),
             " but out is ", tensor_str(out), "; they must have the same dtype");
}

void check_op(const ProcessGroup& g, const char* op, const Tensor& t, ReduceOp rop) {
  LOOM_CHECK(!(rop == ReduceOp::avg && t.dtype() == DType::i32), op, " on ", g.describe(),
             ": avg is not supported for int32 (it would truncate); use sum");
}

// Overlapping in/out would let MPI read what it already wrote.
bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a.raw()), pb = reinterpret_cast<uintptr_t>(b.raw());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

void check_peer(const ProcessGroup& g, const char* op, int peer) {
  LOOM_CHECK(peer >= 0 && peer < g.size(), op, " on ", g.describe(), ": peer ", peer,
             " is outside [0, ", g.size(), ")");
}

}  // namespace

std::unique_ptr<Work> ProcessGroup::all_gather(const Tensor& in, const Tensor& out) {
  const char* op = "all_gather";
  check_tensor(*this, op, "in", in);
  check_tensor(*this, op, "out", out);
  check_same_dtype(*this, op, in, out);
  LOOM_CHECK(out.numel() == size() * in.numel(), op, " on ", describe(), ": out ", tensor_str(out),
             " has ", out.numel(), " elements, expected size * in.numel() = ", size(), " * ",
             in.numel(), " = ", size() * in.numel());
  if (overlaps(in, out)) {
    const char* block = static_cast<const char*>(out.raw()) + rank() * in.nbytes();
    LOOM_CHECK(in.raw() == block, op, " on ", describe(),
               ": in overlaps out but is not this rank's block of out (block ", rank(), ")");
  }
  count(op, (size() - 1) * in.nbytes());
  return do_all_gather(in, out);
}

std::unique_ptr<Work> ProcessGroup::reduce_scatter(const Tensor& in, const Tensor& out,
                                                   ReduceOp rop) {
  const char* op = "reduce_scatter";
  check_tensor(*this, op, "in", in);
  check_tensor(*this, op, "out", out);
  check_same_dtype(*this, op, in, out);
  check_op(*this, op, in, rop);
  LOOM_CHECK(in.numel() == size() * out.numel(), op, " on ", describe(), ": in ", tensor_str(in),
             " has ", in.numel(), " elements, expected size * out.numel() = ", size(), " * ",
             out.numel(), " = ", size() * out.numel());
  LOOM_CHECK(!overlaps(in, out), op, " on ", describe(), ": in and out overlap");
  count(op, (size() - 1) * out.nbytes());
  return do_reduce_scatter(in, out, rop);
}

std::unique_ptr<Work> ProcessGroup::all_reduce(const Tensor& t, ReduceOp rop) {
  const char* op = "all_reduce";
  check_tensor(*this, op, "tensor", t);
  check_op(*this, op, t, rop);
  count(op, 2 * (size() - 1) * t.nbytes() / size());
  return do_all_reduce(t, rop);
}

std::unique_ptr<Work> ProcessGroup::broadcast(const Tensor& t, int root) {
  const char* op = "broadcast";
  check_tensor(*this, op, "tensor", t);
  LOOM_CHECK(root >= 0 && root < size(), op, " on ", describe(), ": root ", root,
             " is outside [0, ", size(), ")");
  count(op, root == rank() ? t.nbytes() : 0);
  return do_broadcast(t, root);
}

std::unique_ptr<Work> ProcessGroup::send(const Tensor& t, int peer, int tag) {
  const char* op = "send";
  check_tensor(*this, op, "tensor", t);
  check_peer(*this, op, peer);
  LOOM_CHECK(tag >= 0, op, " on ", describe(), ": tag ", tag, " must be non-negative");
  count(op, t.nbytes());
  return do_send(t, peer, tag);
}

std::unique_ptr<Work> ProcessGroup::recv(const Tensor& t, int peer, int tag) {
  const char* op = "recv";
  check_tensor(*this, op, "tensor", t);
  check_peer(*this, op, peer);
  LOOM_CHECK(tag >= 0, op, " on ", describe(), ": tag ", tag, " must be non-negative");
  count(op, 0);
  return do_recv(t, peer, tag);
}

std::unique_ptr<Work> ProcessGroup::all_to_all(const Tensor& in, const Tensor& out) {
  const char* op = "all_to_all";
  check_tensor(*this, op, "in", in);
  check_tensor(*this, op, "out", out);
  check_same_dtype(*this, op, in, out);
  LOOM_CHECK(in.numel() == out.numel() && in.numel() % size() == 0, op, " on ", describe(), ": in ",
             tensor_str(in), " and out ", tensor_str(out),
             " must have the same number of elements, a multiple of the group size ", size());
  LOOM_CHECK(!overlaps(in, out), op, " on ", describe(), ": in and out overlap");
  count(op, (size() - 1) * in.nbytes() / size());
  return do_all_to_all(in, out);
}

std::unique_ptr<Work> ProcessGroup::all_to_all_v(const Tensor& in,
                                                 std::span<const int64_t> send_rows,
                                                 const Tensor& out,
                                                 std::span<const int64_t> recv_rows) {
  const char* op = "all_to_all_v";
  check_tensor(*this, op, "in", in);
  check_tensor(*this, op, "out", out);
  check_same_dtype(*this, op, in, out);
  for (const Tensor* t : {&in, &out}) {
    LOOM_CHECK(t->ndim() >= 1, op, " on ", describe(), ": ", t == &in ? "in" : "out", " ",
               tensor_str(*t), " has no dim 0 to hold rows");
  }
  // Rows along dim 0; W from the other dims, so that a tensor of no rows still has a width.
  auto width = [](const Tensor& t) {
    int64_t w = 1;
    for (int64_t d = 1; d < t.ndim(); ++d) w *= t.size(d);
    return w;
  };
  const int64_t w = width(in);
  LOOM_CHECK(width(out) == w, op, " on ", describe(), ": in ", tensor_str(in), " has rows of ", w,
             " elements but out ", tensor_str(out), " has rows of ", width(out));
  const auto check_rows = [&](const char* what, std::span<const int64_t> rows, const Tensor& t,
                              const char* name) {
    LOOM_CHECK(rows.size() == size_t(size()), op, " on ", describe(), ": ", what, " has ",
               rows.size(), " entries, expected one per rank (", size(), ")");
    int64_t sum = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      LOOM_CHECK(rows[i] >= 0, op, " on ", describe(), ": ", what, "[", i, "] = ", rows[i],
                 " is negative");
      sum += rows[i];
    }
    LOOM_CHECK(sum == t.size(0), op, " on ", describe(), ": ", what, " sum to ", sum, " rows but ",
               name, " ", tensor_str(t), " has ", t.size(0));
  };
  check_rows("send_rows", send_rows, in, "in");
  check_rows("recv_rows", recv_rows, out, "out");
  LOOM_CHECK(send_rows[size_t(rank())] == recv_rows[size_t(rank())], op, " on ", describe(),
             ": this rank (", rank(), ") sends itself send_rows[", rank(),
             "] = ", send_rows[size_t(rank())], " rows but expects recv_rows[", rank(),
             "] = ", recv_rows[size_t(rank())]);
  LOOM_CHECK(!overlaps(in, out), op, " on ", describe(), ": in and out overlap");
  const uint64_t row_bytes = uint64_t(w) * dtype_size(in.dtype());
  uint64_t bytes = 0;
  for (int p = 0; p < size(); ++p)
    if (p != rank()) bytes += uint64_t(send_rows[size_t(p)]) * row_bytes;
  count(op, bytes);
  return do_all_to_all_v(in, send_rows, out, recv_rows, w);
}

std::unique_ptr<Work> ProcessGroup::barrier() {
  count("barrier", 0);
  return do_barrier();
}

void divide_inplace(const Tensor& t, int n) {
  if (n == 1) return;
  const int64_t len = t.numel();
  const float fn = static_cast<float>(n);
  switch (t.dtype()) {
    case DType::f32: {
      float* p = t.data<float>();
      for (int64_t i = 0; i < len; ++i) p[i] /= fn;
      break;
    }
    case DType::bf16: {
      bf16* p = t.data<bf16>();
      for (int64_t i = 0; i < len; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / fn);
      break;
    }
    default:
      fail("avg reduction of a ", dtype_name(t.dtype()), " tensor is not supported");
  }
}

// ---- single process ----

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

void copy_bytes(const Tensor& dst, const Tensor& src) {
  if (dst.nbytes() == 0 || dst.raw() == src.raw()) return;
  if (!holds_data(dst.device()) || !holds_data(src.device())) return;
  std::memcpy(dst.raw(), src.raw(), dst.nbytes());
}

}  // namespace

struct SingleProcessGroup::PendingRecv {
  Tensor buf;
  bool done = false;
};

class SelfRecvWork final : public Work {
 public:
  SelfRecvWork(std::shared_ptr<bool> done, std::string what)
      : done_(std::move(done)), what_(std::move(what)) {}
  void wait() override {
    LOOM_CHECK(*done_, what_, " has no matching send to self: waiting would never end");
  }
  bool test() override { return *done_; }

 private:
  std::shared_ptr<bool> done_;
  std::string what_;
};

SingleProcessGroup::SingleProcessGroup(std::string name, int world_rank)
    : ProcessGroup(std::move(name), 0, {world_rank}) {}

std::unique_ptr<ProcessGroup> SingleProcessGroup::split(int color, int key, std::string name) {
  LOOM_CHECK(color >= 0, "split of ", describe(), ": color ", color, " must be non-negative");
  (void)key;
  return std::make_unique<SingleProcessGroup>(std::move(name), world_rank());
}

std::unique_ptr<Work> SingleProcessGroup::do_all_gather(const Tensor& in, const Tensor& out) {
  copy_bytes(out, in);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_reduce_scatter(const Tensor& in, const Tensor& out,
                                                            ReduceOp) {
  copy_bytes(out, in);  // avg over one rank is the value itself
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_all_reduce(const Tensor&, ReduceOp) {
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_broadcast(const Tensor&, int) {
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_send(const Tensor& t, int, int tag) {
  auto& pending = pending_recvs_[tag];
  if (!pending.empty()) {
    PendingRecv& r = *pending.front();
    LOOM_CHECK(r.buf.numel() == t.numel() && r.buf.dtype() == t.dtype(), "send on ", describe(),
               ": sends ", tensor_str(t), " but the matching recv (tag ", tag, ") expects ",
               tensor_str(r.buf));
    copy_bytes(r.buf, t);
    r.done = true;
    pending.pop_front();
  } else {
    Tensor copy = Tensor::empty(t.shape(), t.dtype(), t.device());
    copy_bytes(copy, t);
    unmatched_sends_[tag].push_back(std::move(copy));
  }
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_recv(const Tensor& t, int, int tag) {
  auto& sends = unmatched_sends_[tag];
  if (!sends.empty()) {
    const Tensor& s = sends.front();
    LOOM_CHECK(s.numel() == t.numel() && s.dtype() == t.dtype(), "recv on ", describe(),
               ": expects ", tensor_str(t), " but the matching send (tag ", tag, ") sent ",
               tensor_str(s));
    copy_bytes(t, s);
    sends.pop_front();
    return std::make_unique<DoneWork>();
  }
  auto r = std::make_shared<PendingRecv>();
  r->buf = t;
  pending_recvs_[tag].push_back(r);
  // The work sees `done` through the aliasing constructor, so it keeps the request alive.
  return std::make_unique<SelfRecvWork>(std::shared_ptr<bool>(r, &r->done),
                                        str_cat("recv (tag ", tag, ") on ", describe()));
}

std::unique_ptr<Work> SingleProcessGroup::do_all_to_all(const Tensor& in, const Tensor& out) {
  copy_bytes(out, in);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_all_to_all_v(const Tensor& in,
                                                          std::span<const int64_t>,
                                                          const Tensor& out,
                                                          std::span<const int64_t>, int64_t) {
  copy_bytes(out, in);  // one rank: send_rows == recv_rows, all to itself
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> SingleProcessGroup::do_barrier() {
  return std::make_unique<DoneWork>();
}

}  // namespace loom::dist
