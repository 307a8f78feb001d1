#include "tests/support/thread_process_group.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "core/error.hpp"

namespace loom::test {

// One lock for all groups of a run: a failing rank must wake the waits of every group.
struct World {
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
};

using Bytes = std::vector<std::byte>;

struct PostedOp {
  std::string op;
  std::vector<Bytes> in;  // every rank's input, by rank
  int arrived = 0, consumed = 0;
  int root = -1;
  // split: the new groups' rendezvous by color, made by the first rank to complete the split.
  std::map<int, std::shared_ptr<Rendezvous>> children;
};

struct Rendezvous {
  Rendezvous(std::shared_ptr<World> w, int n) : world(std::move(w)), size(n) {}
  std::shared_ptr<World> world;
  int size;
  std::map<uint64_t, PostedOp> ops;  // collectives in flight, by their number
  // Point to point: (source, destination, tag) -> messages by their number in send order, and
  // how many have been sent and how many recvs posted.
  using Key = std::tuple<int, int, int>;
  std::map<std::tuple<int, int, int, uint64_t>, Bytes> messages;
  std::map<Key, uint64_t> sent, posted;
};

namespace {

// A wait ended by another rank's failure: run_ranks reports that failure instead.
struct PeerFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Bytes bytes_of(const Tensor& t) {
  Bytes b(t.defined() ? t.nbytes() : 0);
  if (!b.empty()) std::memcpy(b.data(), t.raw(), b.size());
  return b;
}

// Waits on the world's condition until `ready`, throwing on an abort or after `timeout_s`.
void wait_until(std::unique_lock<std::mutex>& lock, World& w, double timeout_s,
                const std::string& what, const std::function<bool()>& ready) {
  const auto limit = std::chrono::duration<double>(timeout_s);
  const bool ok = w.cv.wait_for(lock, limit, [&] { return w.aborted || ready(); });
  if (w.aborted) throw PeerFailed(what + ": another rank failed");
  if (!ok) {
    w.aborted = true;
    w.cv.notify_all();
    fail(what, ": no match after ", timeout_s, " s (did every rank issue it?)");
  }
}

// acc = x + acc element-wise in the tensor's dtype (bf16 rounded after the addition).
void add_into(DType dt, const std::byte* x, std::byte* acc, int64_t n) {
  switch (dt) {
    case DType::f32: {
      const auto* a = reinterpret_cast<const float*>(x);
      auto* b = reinterpret_cast<float*>(acc);
      for (int64_t i = 0; i < n; ++i) b[i] = a[i] + b[i];
      return;
    }
    case DType::bf16: {
      const auto* a = reinterpret_cast<const bf16*>(x);
      auto* b = reinterpret_cast<bf16*>(acc);
      for (int64_t i = 0; i < n; ++i)
        b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
      return;
    }
    case DType::i32: {
      const auto* a = reinterpret_cast<const int32_t*>(x);
      auto* b = reinterpret_cast<int32_t*>(acc);
      for (int64_t i = 0; i < n; ++i) b[i] = a[i] + b[i];
      return;
    }
    default:
      fail("thread process group: no sum for ", dtype_name(dt));
  }
}

// out = the sum over ranks, in rank order, of bytes [offset, offset + out.nbytes) of each input.
void reduce_block(const PostedOp& op, size_t offset, const Tensor& out, dist::ReduceOp rop,
                  int size) {
  const size_t n = out.nbytes();
  auto* dst = static_cast<std::byte*>(out.raw());
  std::memcpy(dst, op.in[0].data() + offset, n);
  for (size_t r = 1; r < op.in.size(); ++r)
    add_into(out.dtype(), op.in[r].data() + offset, dst, out.numel());
  if (rop == dist::ReduceOp::avg) dist::divide_inplace(out, size);
}

class DoneWork final : public dist::Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

}  // namespace

// A collective of this rank: completes in wait(), writing the output from every rank's input.
class ThreadProcessGroup::CollectiveWork final : public dist::Work {
 public:
  CollectiveWork(ThreadProcessGroup& g, uint64_t id, std::string label, Finish finish)
      : g_(g), id_(id), label_(std::move(label)), finish_(std::move(finish)) {}
  ~CollectiveWork() override {
    // As MPI's Works, a dropped one still completes; not while this rank unwinds an error, when
    // the others may never get there: they are told instead.
    if (done_) return;
    if (std::uncaught_exceptions() > 0) {
      const std::lock_guard<std::mutex> lock(g_.rv_->world->mu);
      g_.rv_->world->aborted = true;
      g_.rv_->world->cv.notify_all();
      return;
    }
    try {
      wait();
    } catch (const std::exception&) {  // reported by the rank whose wait failed first
    }
  }
  void wait() override {
    if (done_) return;
    g_.log_.push_back(label_ + " wait");
    Rendezvous& rv = *g_.rv_;
    std::unique_lock<std::mutex> lock(rv.world->mu);
    PostedOp& op = rv.ops.at(id_);
    wait_until(lock, *rv.world, g_.timeout_seconds(), str_cat(label_, " on ", g_.describe()),
               [&] { return op.arrived == rv.size; });
    done_ = true;
    finish_(op);
    if (++op.consumed == rv.size) rv.ops.erase(id_);
  }
  bool test() override { return done_; }

 private:
  ThreadProcessGroup& g_;
  uint64_t id_;
  std::string label_;
  Finish finish_;
  bool done_ = false;
};

class ThreadProcessGroup::RecvWork final : public dist::Work {
 public:
  RecvWork(ThreadProcessGroup& g, std::tuple<int, int, int, uint64_t> key, Tensor t,
           std::string label)
      : g_(g), key_(key), t_(std::move(t)), label_(std::move(label)) {}
  ~RecvWork() override {
    if (!done_ && std::uncaught_exceptions() == 0) try {
        wait();
      } catch (const std::exception&) {
      }
  }
  void wait() override {
    if (done_) return;
    g_.log_.push_back(label_ + " wait");
    Rendezvous& rv = *g_.rv_;
    std::unique_lock<std::mutex> lock(rv.world->mu);
    wait_until(lock, *rv.world, g_.timeout_seconds(), str_cat(label_, " on ", g_.describe()),
               [&] { return rv.messages.count(key_) > 0; });
    done_ = true;
    const Bytes& m = rv.messages.at(key_);
    LOOM_CHECK(m.size() == t_.nbytes(), label_, " on ", g_.describe(), ": expects ", t_.nbytes(),
               " bytes, the matching send sent ", m.size());
    if (!m.empty()) std::memcpy(t_.raw(), m.data(), m.size());
    rv.messages.erase(key_);
  }
  bool test() override { return done_; }

 private:
  ThreadProcessGroup& g_;
  std::tuple<int, int, int, uint64_t> key_;
  Tensor t_;
  std::string label_;
  bool done_ = false;
};

ThreadProcessGroup::ThreadProcessGroup(std::string name, int rank, std::vector<int> world_ranks,
                                       std::shared_ptr<Rendezvous> rendezvous)
    : ProcessGroup(std::move(name), rank, std::move(world_ranks)), rv_(std::move(rendezvous)) {
  LOOM_CHECK(rv_ && rv_->size == size(), "thread process group '", this->name(),
             "': rendezvous of another size");
}

std::unique_ptr<dist::Work> ThreadProcessGroup::post(std::string_view op, const Tensor& in,
                                                     Finish finish, int root) {
  return post_bytes(op, bytes_of(in), std::move(finish), root);
}

std::unique_ptr<dist::Work> ThreadProcessGroup::post_bytes(std::string_view op, Bytes in,
                                                           Finish finish, int root) {
  const uint64_t id = next_op_++;
  std::string label = str_cat(op, "#", id);
  log_.push_back(label + " issue");
  {
    const std::lock_guard<std::mutex> lock(rv_->world->mu);
    PostedOp& p = rv_->ops[id];
    if (p.arrived == 0) {
      p.op = std::string(op);
      p.in.resize(size_t(size()));
      p.root = root;
    }
    LOOM_CHECK(p.op == op && p.root == root, describe(), ": rank ", rank(), " issued ", op,
               " as collective #", id, " where another rank issued ", p.op);
    p.in[size_t(rank())] = std::move(in);
    ++p.arrived;
    rv_->world->cv.notify_all();
  }
  return std::make_unique<CollectiveWork>(*this, id, std::move(label), std::move(finish));
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_all_gather(const Tensor& in, const Tensor& out) {
  return post("all_gather", in, [out](PostedOp& op) {
    auto* dst = static_cast<std::byte*>(out.raw());
    for (const Bytes& b : op.in) dst = std::copy(b.begin(), b.end(), dst);
  });
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_reduce_scatter(const Tensor& in,
                                                                  const Tensor& out,
                                                                  dist::ReduceOp rop) {
  const int r = rank(), n = size();
  return post("reduce_scatter", in, [out, rop, r, n](PostedOp& op) {
    reduce_block(op, size_t(r) * out.nbytes(), out, rop, n);
  });
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_all_reduce(const Tensor& t, dist::ReduceOp rop) {
  const int n = size();
  return post("all_reduce", t, [t, rop, n](PostedOp& op) { reduce_block(op, 0, t, rop, n); });
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_broadcast(const Tensor& t, int root) {
  return post(
      "broadcast", t,
      [t, root](PostedOp& op) {
        const Bytes& b = op.in[size_t(root)];
        std::copy(b.begin(), b.end(), static_cast<std::byte*>(t.raw()));
      },
      root);
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_all_to_all(const Tensor& in, const Tensor& out) {
  const int r = rank();
  return post("all_to_all", in, [out, r](PostedOp& op) {
    // Block i of out is block r of rank i's input.
    const size_t block = out.nbytes() / op.in.size();
    auto* dst = static_cast<std::byte*>(out.raw());
    for (size_t i = 0; i < op.in.size(); ++i)
      std::memcpy(dst + i * block, op.in[i].data() + size_t(r) * block, block);
  });
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_all_to_all_v(const Tensor& in,
                                                                std::span<const int64_t> send_rows,
                                                                const Tensor& out,
                                                                std::span<const int64_t> recv_rows,
                                                                int64_t row_elements) {
  // Posted: the row's bytes and send_rows (int64 each), then the rows.
  const size_t n = size_t(size()), header = (n + 1) * sizeof(int64_t);
  const int64_t row = row_elements * int64_t(dtype_size(in.dtype()));
  Bytes posted(header + in.nbytes());
  std::memcpy(posted.data(), &row, sizeof row);
  std::memcpy(posted.data() + sizeof row, send_rows.data(), n * sizeof(int64_t));
  if (in.nbytes() > 0) std::memcpy(posted.data() + header, in.raw(), in.nbytes());
  const int r = rank();
  std::vector<int64_t> expect(recv_rows.begin(), recv_rows.end());
  return post_bytes("all_to_all_v", std::move(posted),
                    [out, r, n, header, row, expect,
                     what = str_cat("all_to_all_v on ", describe())](PostedOp& op) {
                      auto* dst = static_cast<std::byte*>(out.raw());
                      for (size_t i = 0; i < n; ++i) {
                        const std::byte* b = op.in[i].data();
                        int64_t their_row, sent[2];  // rows to the ranks before r, rows to r
                        std::memcpy(&their_row, b, sizeof their_row);
                        LOOM_CHECK(their_row == row, what, ": rank ", i, " has rows of ", their_row,
                                   " bytes, this rank (", r, ") of ", row);
                        sent[0] = 0;
                        for (int q = 0; q < r; ++q) {
                          int64_t c;
                          std::memcpy(&c, b + (1 + q) * sizeof c, sizeof c);
                          sent[0] += c;
                        }
                        std::memcpy(&sent[1], b + (1 + r) * sizeof(int64_t), sizeof(int64_t));
                        LOOM_CHECK(sent[1] == expect[i], what, ": rank ", i, " sends ", sent[1],
                                   " rows to rank ", r, " but rank ", r, " expects recv_rows[", i,
                                   "] = ", expect[i]);
                        const size_t bytes = size_t(sent[1] * row);
                        if (bytes > 0) std::memcpy(dst, b + header + size_t(sent[0] * row), bytes);
                        dst += bytes;
                      }
                    });
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_barrier() {
  return post("barrier", Tensor(), [](PostedOp&) {});
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_send(const Tensor& t, int peer, int tag) {
  log_.push_back(str_cat("send#", next_p2p_++, " issue"));
  const std::lock_guard<std::mutex> lock(rv_->world->mu);
  const Rendezvous::Key key{rank(), peer, tag};
  rv_->messages[{rank(), peer, tag, rv_->sent[key]++}] = bytes_of(t);
  rv_->world->cv.notify_all();
  return std::make_unique<DoneWork>();
}

std::unique_ptr<dist::Work> ThreadProcessGroup::do_recv(const Tensor& t, int peer, int tag) {
  std::string label = str_cat("recv#", next_p2p_++);
  log_.push_back(label + " issue");
  const std::lock_guard<std::mutex> lock(rv_->world->mu);
  const Rendezvous::Key key{peer, rank(), tag};
  const std::tuple<int, int, int, uint64_t> msg{peer, rank(), tag, rv_->posted[key]++};
  return std::make_unique<RecvWork>(*this, msg, t, std::move(label));
}

std::unique_ptr<dist::ProcessGroup> ThreadProcessGroup::split(int color, int key,
                                                              std::string name) {
  LOOM_CHECK(color >= 0, "split of ", describe(), ": color ", color, " must be non-negative");
  const int32_t mine[2] = {color, key};
  Tensor t = Tensor::empty({2}, DType::i32);
  std::memcpy(t.raw(), mine, sizeof(mine));
  std::vector<int> members;  // group ranks of this color, in the new group's order
  std::shared_ptr<Rendezvous> child;
  const std::shared_ptr<World> world = rv_->world;
  post("split", t, [&](PostedOp& op) {
    std::vector<std::tuple<int, int>> order;  // (key, rank) of this color
    for (int r = 0; r < size(); ++r) {
      int32_t ck[2];
      std::memcpy(ck, op.in[size_t(r)].data(), sizeof(ck));
      if (ck[0] == color) order.emplace_back(ck[1], r);
    }
    std::sort(order.begin(), order.end());
    for (const auto& [k, r] : order) members.push_back(r);
    // Under the world's lock (Finish runs there): the first rank of the color makes it.
    std::shared_ptr<Rendezvous>& made = op.children[color];
    if (!made) made = std::make_shared<Rendezvous>(world, int(members.size()));
    child = made;
  })->wait();
  std::vector<int> world_ranks;
  for (int r : members) world_ranks.push_back(this->world_ranks()[size_t(r)]);
  const int new_rank = int(std::find(members.begin(), members.end(), rank()) - members.begin());
  auto g = std::make_unique<ThreadProcessGroup>(std::move(name), new_rank, std::move(world_ranks),
                                                std::move(child));
  g->set_timeout_seconds(timeout_seconds());
  return g;
}

void run_ranks(int n, const std::function<void(ThreadProcessGroup&)>& fn, double timeout_s) {
  LOOM_CHECK(n > 0, "run_ranks: ", n, " ranks");
  auto world = std::make_shared<World>();
  auto rv = std::make_shared<Rendezvous>(world, n);
  std::vector<int> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) ranks[size_t(r)] = r;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadProcessGroup g("world", r, ranks, rv);
        g.set_timeout_seconds(timeout_s);
        fn(g);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
        const std::lock_guard<std::mutex> lock(world->mu);
        world->aborted = true;
        world->cv.notify_all();
      }
    });
  for (std::thread& t : threads) t.join();
  // The lowest rank's own failure, before the failures it caused in the others.
  for (bool own : {true, false})
    for (const std::exception_ptr& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const PeerFailed&) {
        if (!own) throw;
      }
    }
}

}  // namespace loom::test
