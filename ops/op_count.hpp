#pragma once
// How many ops this thread has run, on any device (meta included): a clock of the program, not
// of time. FSDP completes a collective at the first hook after an op has run since its issue
// (parallel/fsdp.cpp), so when its buffers are freed, and the peak with them, is the same in
// every run and on meta as on the cpu, whenever MPI actually finishes.
#include <cstdint>

namespace loom::ops {

uint64_t ops_run();

}  // namespace loom::ops
