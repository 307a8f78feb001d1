// GoogleTest main for the tests that run under mpirun: every rank runs every test (the tests are
// collective), rank 0 prints the usual report, the other ranks print only their failures, and the
// exit code is non-zero if any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <memory>

#include "distributed/mpi_process_group.hpp"

namespace {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[world rank %d] %s:%d: failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  int result = 0;
  {
    loom::dist::MpiRuntime mpi(&argc, &argv);
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    if (mpi.world_rank() != 0) {
      // GoogleTest's listener API passes ownership by raw pointer.
      std::unique_ptr<testing::TestEventListener>(
          listeners.Release(listeners.default_result_printer()));
      listeners.Append(std::make_unique<RankFailurePrinter>(mpi.world_rank()).release());
    }
    int local = RUN_ALL_TESTS();
    MPI_Allreduce(&local, &result, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (mpi.world_rank() == 0 && result != local) {
      std::fprintf(stderr, "distributed_mpi_test: a test failed on another rank (see above)\n");
    }
  }
  return result;
}
