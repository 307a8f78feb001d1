#pragma once
// The CUDA runtime as loom uses it (docs/decisions/cuda.md): what the machine has (a
// probe that never throws, so the same binary runs where there is no GPU or no driver), the one
// GPU this process uses with its compute stream, and the memory functions the Allocator and
// Tensor of Device::cuda go through (core/device_memory.hpp). No CUDA header here: code compiled
// without nvcc's include paths (apps/, tests) includes this.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace loom::cuda {

struct Gpu {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int sms = 0;
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;
  size_t shared_per_block_optin = 0;  // the most shared memory one block may ask for
  int memory_bus_bits = 0;
  std::string pci_bus_id;
};

struct RuntimeInfo {
  bool usable = false;  // a driver that can run this runtime, and at least one GPU
  std::string why_not;  // when not usable: what was found ("no NVIDIA driver (libcuda.so.1)", ...)
  int driver_version = 0;       // the CUDA version the driver supports, 13000 = 13.0 (0: no driver)
  int runtime_version = 0;      // cudart's, linked statically
  size_t cublaslt_version = 0;  // 130100 = 13.1.0
  std::vector<Gpu> gpus;
};

// What the machine has: probed once per process, never throws.
const RuntimeInfo& probe();
// 13000 -> "13.0", 130100 (cuBLASLt's form) -> "13.1.0".
std::string cuda_version_str(int v);
std::string cublaslt_version_str(size_t v);

// Makes GPU `index` this process's device (rank to GPU by local rank): sets it current, creates
// its compute stream and registers the memory functions of Device::cuda. Throws naming what is
// missing (no driver, a driver older than the runtime, no such GPU). Once per process; a second
// call with the same index does nothing.
void start(int index);
// The GPU start() chose, or -1.
int current_device();
// The compute stream every loom kernel of this process runs on (start() first). One stream: a
// block the caching allocator hands out again is only touched by later work on it, so reuse
// needs no event (a second stream would record its uses, as torch's recordStream).
CUstream_st* stream();
// Waits for the stream; an error of any earlier kernel surfaces here, named with `what`, and so
// does a failed deferred check (below). Every wait of the host for the GPU goes through here (a
// copy to the host too), counted by `what`.
void synchronize(const char* what);
// The waits since the process started, by their `what`: `loom bench step` reports a step's.
std::map<std::string, uint64_t> host_waits();

// A check a kernel makes and the host raises later, with no wait of its own (as PyTorch's
// device-side asserts): the kernel leaves a 64-bit word in device memory (all ones: nothing
// found); defer_check queues its copy into pinned host memory behind the kernel, and the next
// synchronize() (a step's loss read, or any other wait) reads it and, where it is not all ones,
// calls `raise` with it, which throws naming the op and the bad value. The checks queued since
// the last wait are looked at in their order, the first failed one raised. device_word may be
// freed once this returns (the copy is queued before any later reuse of the block).
void defer_check(const uint64_t* device_word, std::function<void(uint64_t)> raise);

// Events on the compute stream (a timing region: the op profile, benchmarks).
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start();
  void stop();
  // Waits for stop's event; the milliseconds between the two.
  double elapsed_ms();

 private:
  void* begin_ = nullptr;
  void* end_ = nullptr;
};

}  // namespace loom::cuda
