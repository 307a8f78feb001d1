// Times reduce_scatter (sum) and all_gather of the MPI backend per size (KiB per rank) and dtype:
// the median of several reps, each the collective followed at once by wait(), the ranks lined up
// by a barrier before each. docs/decisions/distributed-runtime.md quotes its figures.
//   mpirun -np N build/bench/collective_bench [reps=9] [max KiB=32768]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "distributed/mpi_process_group.hpp"

using namespace loom;
using namespace loom::dist;

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const int reps = argc > 1 ? std::atoi(argv[1]) : 9;
  const int max_kb = argc > 2 ? std::atoi(argv[2]) : 32768;
  auto g = make_mpi_world_group();
  const int n = g->size();
  if (g->rank() == 0) std::printf("%d ranks, median of %d reps\nKiB/rank dtype op ms\n", n, reps);
  for (DType d : {DType::f32, DType::bf16}) {
    for (int kb : {16, 256, 1024, 2048, 4096, 8192, 16384, 32768}) {
      if (kb > max_kb) break;
      const int64_t numel = (int64_t(kb) << 10) / dtype_size(d);
      Tensor in = Tensor::zeros({n * numel}, d), out = Tensor::zeros({numel}, d);
      for (const char* op : {"reduce_scatter", "all_gather"}) {
        const bool rs = op[0] == 'r';
        std::vector<double> ms;
        for (int i = 0; i <= reps; ++i) {
          MPI_Barrier(MPI_COMM_WORLD);
          const auto t0 = std::chrono::steady_clock::now();
          (rs ? g->reduce_scatter(in, out, ReduceOp::sum) : g->all_gather(out, in))->wait();
          const std::chrono::duration<double, std::milli> t = std::chrono::steady_clock::now() - t0;
          if (i > 0) ms.push_back(t.count());  // the first one warms up
        }
        std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
        if (g->rank() == 0) {
          std::printf("%d %s %s %.2f\n", kb, dtype_name(d).data(), op, ms[reps / 2]);
        }
      }
    }
  }
}
