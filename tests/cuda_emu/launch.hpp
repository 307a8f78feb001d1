#pragma once
// A kernel launch of the CUDA emulation (tests/cuda_emu/device.hpp): its configuration, checked as
// the GPU checks it (tests/cuda_emu/cudart.cpp), and the grid run by tests/cuda_emu/fibers.hpp.
#include <cuda_runtime.h>

#include <cstddef>
#include <tuple>

#include "tests/cuda_emu/fibers.hpp"

namespace loom::cuda_emu {

struct Config {
  dim3 grid, block;
  size_t smem;
  Config(dim3 g, dim3 b, size_t s = 0, cudaStream_t = nullptr) : grid(g), block(b), smem(s) {}
};

// Checks the launch as the GPU would (an invalid one sets the error cudaGetLastError returns and
// runs nothing): tests/cuda_emu/cudart.cpp.
bool launch_ok(const Config& c);

// A launch, as tests/cuda_emu/cu_to_cpp.cpp writes it: `call(args...)` calls the kernel as written
// in the source, for every thread of every block, with copies of the arguments taken once.
template <class Call, class... A>
void launch(const Config& c, Call call, const A&... args) {
  if (!launch_ok(c)) return;
  const std::tuple<A...> values(args...);
  run_grid(Dim{c.grid.x, c.grid.y, c.grid.z}, Dim{c.block.x, c.block.y, c.block.z}, c.smem,
           [&](int) { std::apply(call, values); });
}

}  // namespace loom::cuda_emu
