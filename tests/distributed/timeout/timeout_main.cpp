// Run by tests/distributed/timeout_test.sh under `mpirun -np 2`: world rank 1 never joins an
// all_reduce over the tp group, so world rank 0 must time out, print one line naming the
// collective, the group and the peers, and abort the job (never hang).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "distributed/mesh.hpp"
#include "distributed/mpi_process_group.hpp"

using namespace loom;
using namespace loom::dist;

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const double timeout = argc > 1 ? std::atof(argv[1]) : 2.0;
  auto world = std::shared_ptr<ProcessGroup>(make_mpi_world_group());
  Mesh mesh(MeshShape{1, 1, 1, 1, world->size()}, world);
  mesh.set_timeout_seconds(timeout);
  if (mpi.world_rank() == 0) {
    Tensor t = Tensor::zeros({37}, DType::f32);
    mesh.group("tp").all_reduce(t, ReduceOp::sum)->wait();
    std::fprintf(stderr, "timeout_main: the all_reduce completed, which it must not\n");
    return 0;
  }
  // Stays away for much longer than the timeout; the abort ends this process too.
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}
