// FSDP's hooks (parallel/fsdp.hpp) over 2 ranks of the thread process group (tests/support/), on
// configs/debug.json (embedding, 2 blocks, head: 4 units): the order in which one micro-batch's
// hooks issue and wait for their all-gathers and reduce-scatters, as fsdp.hpp documents it
// (gather before a unit's forward, prefetch of the next, completion at the first hook after an
// op has run since the issue, the last block and the head kept from forward to backward,
// reduce-scatter after each unit's backward), the same on both ranks and in every run.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "model/llama.hpp"
#include "parallel/parallelize.hpp"
#include "tests/support/thread_process_group.hpp"

namespace loom {
namespace {

LlamaConfig tiny() {
  const char* src = std::getenv("LOOM_SOURCE_DIR");
  return LlamaConfig::from_file(std::string(src ? src : ".") + "/configs/debug.json");
}

// Marks each hook in the group's log, then runs FSDP's.
class Marked final : public UnitHooks {
 public:
  Marked(UnitHooks& inner, test::ThreadProcessGroup& g) : inner_(inner), g_(g) {}
  void before_forward(size_t u) override { mark("before_forward", u, &UnitHooks::before_forward); }
  void after_forward(size_t u) override { mark("after_forward", u, &UnitHooks::after_forward); }
  void before_backward(size_t u) override {
    mark("before_backward", u, &UnitHooks::before_backward);
  }
  void after_backward(size_t u) override { mark("after_backward", u, &UnitHooks::after_backward); }

 private:
  void mark(const char* hook, size_t u, void (UnitHooks::*fn)(size_t)) {
    g_.note(std::string(hook) + " " + std::to_string(u));
    (inner_.*fn)(u);
  }
  UnitHooks& inner_;
  test::ThreadProcessGroup& g_;
};

// One micro-batch of FSDP over 2 thread-ranks; every rank's log.
std::vector<std::vector<std::string>> fsdp_logs() {
  std::vector<std::vector<std::string>> logs(2);
  test::run_ranks(2, [&](test::ThreadProcessGroup& g) {
    ParallelGroups groups;
    groups.dp = groups.shard = &g;
    groups.rank = g.rank();
    groups.size = g.size();
    ParallelModel pm = parallelize(tiny(), DType::f32, groups, ParallelizeOptions{});
    ASSERT_TRUE(pm.fsdp);
    pm.model->init_weights(1);
    Marked marked(*pm.fsdp, g);
    pm.model->set_hooks(&marked);
    constexpr int64_t B = 1, T = 16;
    std::vector<int32_t> tokens(B * T + 1);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = int32_t((i * 37 + size_t(g.rank())) % 512);
    g.clear_log();
    pm.model->forward_backward(tokens.data(), tokens.data() + 1, B, T, 1.0f / (2 * B * T));
    g.note("finish_backward");
    pm.fsdp->finish_backward();
    pm.model->set_hooks(pm.fsdp.get());
    logs[size_t(g.rank())] = g.log();
  });
  return logs;
}

TEST(FsdpHooks, GathersAndReduceScattersInTheDocumentedOrder) {
  const std::vector<std::string> expected = {
      // Forward: unit 0 gathered and waited for, unit 1 prefetched and completed after unit 0's
      // compute; each unit's forward prefetches the next; the head (unit 3) has no next.
      "before_forward 0", "all_gather#0 issue", "all_gather#0 wait", "all_gather#1 issue",
      "after_forward 0", "all_gather#1 wait",  //
      "before_forward 1", "all_gather#2 issue", "after_forward 1", "all_gather#2 wait",
      "before_forward 2", "all_gather#3 issue", "after_forward 2", "all_gather#3 wait",
      "before_forward 3", "after_forward 3",
      // Backward: the head and the last block were kept (no gather); blocks 1 and 0 are
      // gathered again a unit ahead. Each unit's gradient is reduce-scattered after its
      // backward; that and each prefetch are waited for at the first hook after an op has run
      // since their issue (none runs between after_backward 3 and before_backward 2).
      "before_backward 3", "after_backward 3", "reduce_scatter#4 issue",  //
      "before_backward 2", "all_gather#5 issue",                          //
      "after_backward 2", "reduce_scatter#6 issue", "all_gather#5 wait", "reduce_scatter#4 wait",
      "before_backward 1", "reduce_scatter#6 wait", "all_gather#7 issue",  //
      "after_backward 1", "reduce_scatter#8 issue", "all_gather#7 wait",   //
      "before_backward 0",                                                 //
      "after_backward 0", "reduce_scatter#9 issue", "reduce_scatter#8 wait",
      // What is still in flight completes in finish_backward.
      "finish_backward", "reduce_scatter#9 wait"};
  const auto logs = fsdp_logs();
  std::string got;  // gtest prints only the start of a long vector
  for (const std::string& line : logs[0]) got += "\n  " + line;
  EXPECT_EQ(logs[0], expected) << "rank 0's log:" << got;
  EXPECT_EQ(logs[1], logs[0]);
  EXPECT_EQ(fsdp_logs(), logs);  // and in every run
}

}  // namespace
}  // namespace loom
