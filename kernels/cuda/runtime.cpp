#include "kernels/cuda/runtime.hpp"

#include <cublasLt.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <utility>

#include "core/device_memory.hpp"
#include "core/error.hpp"
#include "kernels/cuda/check.hpp"

namespace loom::cuda {

void check(cudaError_t e, const char* op, const char* call) {
  if (e == cudaSuccess) return;
  // The sticky error state is cleared where it can be (an out-of-memory is not sticky).
  cudaGetLastError();
  fail(op, ": ", call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

void check_launch(const char* op) {
  check(cudaGetLastError(), op, "kernel launch");
}

std::string cuda_version_str(int v) {
  return str_cat(v / 1000, ".", (v % 1000) / 10);
}

std::string cublaslt_version_str(size_t v) {
  return str_cat(v / 10000, ".", (v % 10000) / 100, ".", v % 100);
}

namespace {

RuntimeInfo probe_now() {
  RuntimeInfo r;
  cudaRuntimeGetVersion(&r.runtime_version);
  r.cublaslt_version = cublasLtGetVersion();
  // cudart is linked statically and loads the driver (libcuda.so.1) itself: without one these
  // calls fail with an error code, never at load time.
  cudaDriverGetVersion(&r.driver_version);
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (r.driver_version == 0) {
    r.why_not = "no NVIDIA driver (libcuda.so.1 not found)";
    return r;
  }
  if (e == cudaErrorInsufficientDriver || r.driver_version < r.runtime_version) {
    r.why_not = str_cat("the NVIDIA driver supports CUDA ", cuda_version_str(r.driver_version),
                        ", older than loom's runtime ", cuda_version_str(r.runtime_version),
                        ": update the driver");
    return r;
  }
  if (e != cudaSuccess || n == 0) {
    r.why_not =
        e == cudaSuccess || e == cudaErrorNoDevice
            ? std::string("no GPU found")
            : str_cat("no GPU usable: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
    return r;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    Gpu g;
    g.index = i;
    g.name = p.name;
    g.major = p.major;
    g.minor = p.minor;
    g.sms = p.multiProcessorCount;
    g.memory_bytes = p.totalGlobalMem;
    g.l2_bytes = size_t(p.l2CacheSize);
    g.shared_per_block_optin = p.sharedMemPerBlockOptin;
    g.memory_bus_bits = p.memoryBusWidth;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, i) == cudaSuccess) g.pci_bus_id = bus;
    r.gpus.push_back(g);
  }
  r.usable = !r.gpus.empty();
  if (!r.usable) r.why_not = "no GPU's properties could be read";
  return r;
}

struct State {
  std::mutex mu;
  int device = -1;
  cudaStream_t stream = nullptr;
};
State& state() {
  static State s;
  return s;
}

void* reserve(size_t bytes, bool host) {
  void* p = nullptr;
  const cudaError_t e = host ? cudaMallocHost(&p, bytes) : cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;  // the Allocator flushes its cache and retries, then names the sizes
  }
  check(e, "allocator", host ? "cudaMallocHost" : "cudaMalloc");
  return p;
}
void release(void* p, bool host) {
  // Also called by the allocators' destructors at exit: it must not throw, and once the runtime
  // is unloading there is nothing left to free.
  const cudaError_t e = host ? cudaFreeHost(p) : cudaFree(p);
  if (e != cudaSuccess && e != cudaErrorCudartUnloading)
    std::fprintf(stderr, "loom: warning: %s failed: %s\n", host ? "cudaFreeHost" : "cudaFree",
                 cudaGetErrorString(e));
  cudaGetLastError();
}
void mem_info(size_t* free, size_t* total) {
  if (cudaMemGetInfo(free, total) != cudaSuccess) {
    cudaGetLastError();
    *free = *total = 0;
  }
}
void zero(void* dst, size_t bytes) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream()), "zero");
}
void copy(void* dst, const void* src, size_t bytes, bool to_device, bool from_device) {
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()), "copy");
  // The host reads what arrives as soon as the call returns.
  if (from_device && !to_device) synchronize("copy to the host");
}

}  // namespace

const RuntimeInfo& probe() {
  static const RuntimeInfo r = probe_now();
  return r;
}

void start(int index) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.device == index) return;
  LOOM_CHECK(s.device < 0, "cuda::start(", index, "): this process already uses GPU ", s.device);
  const RuntimeInfo& r = probe();
  LOOM_CHECK(r.usable, "no GPU to use: ", r.why_not);
  LOOM_CHECK(index >= 0 && index < int(r.gpus.size()), "GPU ", index, " asked for, but ",
             r.gpus.size(), " found");
  LOOM_CUDA_CHECK(cudaSetDevice(index), "start");
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "start");
  s.device = index;
  DeviceMemory m;
  m.reserve = reserve;
  m.release = release;
  m.mem_info = mem_info;
  m.zero = zero;
  m.copy = copy;
#ifdef LOOM_CUDA_EMULATION
  m.host_addressable = true;  // the emulated GPU's memory is the host's (tests/cuda_emu/cudart.cpp)
#endif
  register_device_memory(Device::cuda, m);
}

int current_device() {
  return state().device;
}

CUstream_st* stream() {
  cudaStream_t st = state().stream;
  LOOM_CHECK(st, "no CUDA stream: cuda::start was not called");
  return st;
}

namespace {

// The deferred checks since the last wait: each a word of pinned host memory the check's copy
// lands in, and what raises it. Pinned in chunks of 512 words, kept for the process (freed at
// exit) and reused after every wait; more than kMostPending checks without a wait (a program
// that never reads the GPU back) waits itself.
class DeferredChecks {
 public:
  static constexpr size_t kChunk = 512, kMostPending = 8 * kChunk;

  uint64_t* slot() {
    const size_t i = pending_.size();
    if (i / kChunk == chunks_.size()) {
      void* p = nullptr;
      LOOM_CUDA_CHECK(cudaMallocHost(&p, kChunk * sizeof(uint64_t)), "defer_check");
      chunks_.emplace_back(static_cast<uint64_t*>(p));
    }
    return chunks_[i / kChunk].get() + i % kChunk;
  }
  void add(uint64_t* slot, std::function<void(uint64_t)> raise) {
    pending_.push_back({slot, std::move(raise)});
  }
  size_t pending() const { return pending_.size(); }
  // After a wait: the pending checks, taken (so that a raise leaves none behind).
  std::vector<std::pair<uint64_t*, std::function<void(uint64_t)>>> take() {
    return std::exchange(pending_, {});
  }

 private:
  struct FreeHost {
    void operator()(uint64_t* p) const { cudaFreeHost(p); }
  };
  std::vector<std::unique_ptr<uint64_t, FreeHost>> chunks_;
  std::vector<std::pair<uint64_t*, std::function<void(uint64_t)>>> pending_;
};

struct Waits {
  std::mutex mu;
  DeferredChecks checks;
  std::map<std::string, uint64_t> count;
};
Waits& waits() {
  static Waits w;
  return w;
}

}  // namespace

void synchronize(const char* what) {
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream()), what);
  Waits& w = waits();
  std::vector<std::pair<uint64_t*, std::function<void(uint64_t)>>> done;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    ++w.count[what];
    done = w.checks.take();
  }
  for (const auto& [slot, raise] : done)
    if (*slot != ~uint64_t{0}) raise(*slot);
}

std::map<std::string, uint64_t> host_waits() {
  Waits& w = waits();
  std::lock_guard<std::mutex> lock(w.mu);
  return w.count;
}

void defer_check(const uint64_t* device_word, std::function<void(uint64_t)> raise) {
  Waits& w = waits();
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    uint64_t* slot = w.checks.slot();
    LOOM_CUDA_CHECK(
        cudaMemcpyAsync(slot, device_word, sizeof(uint64_t), cudaMemcpyDeviceToHost, stream()),
        "defer_check");
    w.checks.add(slot, std::move(raise));
    full = w.checks.pending() >= DeferredChecks::kMostPending;
  }
  if (full) synchronize("deferred checks");
}

EventTimer::EventTimer() {
  cudaEvent_t a = nullptr, b = nullptr;
  LOOM_CUDA_CHECK(cudaEventCreate(&a), "EventTimer");
  LOOM_CUDA_CHECK(cudaEventCreate(&b), "EventTimer");
  begin_ = a;
  end_ = b;
}
EventTimer::~EventTimer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(begin_));
  cudaEventDestroy(static_cast<cudaEvent_t>(end_));
}
void EventTimer::start() {
  LOOM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(begin_), stream()), "EventTimer");
}
void EventTimer::stop() {
  LOOM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(end_), stream()), "EventTimer");
}
double EventTimer::elapsed_ms() {
  LOOM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end_)), "EventTimer");
  float ms = 0;
  LOOM_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin_), static_cast<cudaEvent_t>(end_)),
      "EventTimer");
  return ms;
}

}  // namespace loom::cuda
