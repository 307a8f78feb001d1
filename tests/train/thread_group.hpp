#pragma once
// Ranks as threads of one process, for tests of code whose collectives need no real transport
// (the checkpoint's all-gathers): all_gather and barrier only.
#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <vector>

#include "core/error.hpp"
#include "distributed/process_group.hpp"

namespace loom::test {

class ThreadWorld {
 public:
  explicit ThreadWorld(int n) : n_(n), barrier_(n), slots_(size_t(n)) {}
  int size() const { return n_; }
  // Run by rank 0 in each all_gather while every rank is inside it: a test's way to change the
  // world at a known point of a collective protocol.
  std::function<void()> during_gather;

 private:
  friend class ThreadGroup;
  int n_;
  std::barrier<> barrier_;
  std::vector<Tensor> slots_;
};

class ThreadGroup final : public dist::ProcessGroup {
 public:
  ThreadGroup(ThreadWorld& w, int rank) : ProcessGroup("threads", rank, iota(w.size())), w_(w) {}
  std::string_view backend() const override { return "threads"; }
  std::unique_ptr<ProcessGroup> split(int, int, std::string) override { fail("threads: no split"); }

 protected:
  std::unique_ptr<dist::Work> do_all_gather(const Tensor& in, const Tensor& out) override {
    w_.slots_[size_t(rank())] = in;
    w_.barrier_.arrive_and_wait();
    if (rank() == 0 && w_.during_gather) w_.during_gather();
    for (int r = 0; r < size(); ++r)
      std::memcpy(static_cast<char*>(out.raw()) + size_t(r) * in.nbytes(),
                  w_.slots_[size_t(r)].raw(), in.nbytes());
    w_.barrier_.arrive_and_wait();
    return std::make_unique<Done>();
  }
  std::unique_ptr<dist::Work> do_barrier() override {
    w_.barrier_.arrive_and_wait();
    return std::make_unique<Done>();
  }
  std::unique_ptr<dist::Work> do_reduce_scatter(const Tensor&, const Tensor&,
                                                dist::ReduceOp) override {
    fail("threads: no reduce_scatter");
  }
  std::unique_ptr<dist::Work> do_all_reduce(const Tensor&, dist::ReduceOp) override {
    fail("threads: no all_reduce");
  }
  std::unique_ptr<dist::Work> do_broadcast(const Tensor&, int) override {
    fail("threads: no broadcast");
  }
  std::unique_ptr<dist::Work> do_send(const Tensor&, int, int) override {
    fail("threads: no send");
  }
  std::unique_ptr<dist::Work> do_recv(const Tensor&, int, int) override {
    fail("threads: no recv");
  }
  std::unique_ptr<dist::Work> do_all_to_all(const Tensor&, const Tensor&) override {
    fail("threads: no all_to_all");
  }
  std::unique_ptr<dist::Work> do_all_to_all_v(const Tensor&, std::span<const int64_t>,
                                              const Tensor&, std::span<const int64_t>,
                                              int64_t) override {
    fail("threads: no all_to_all_v");
  }

 private:
  struct Done final : dist::Work {
    void wait() override {}
    bool test() override { return true; }
  };
  static std::vector<int> iota(int n) {
    std::vector<int> v(static_cast<size_t>(n));
    std::iota(v.begin(), v.end(), 0);
    return v;
  }
  ThreadWorld& w_;
};

}  // namespace loom::test
