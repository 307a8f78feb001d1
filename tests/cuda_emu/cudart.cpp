// The CUDA emulation's runtime (tests/cuda_emu/device.hpp): the CUDA runtime API calls loom makes,
// defined over host memory, so the real kernels/cuda code, compiled by g++, runs on a machine
// without a GPU. One emulated GPU ("loom CUDA emulation", compute capability 9.0, an H100's limits:
// 132 SMs, 227 KiB of shared memory per block at most, 1024 threads per block). Device memory is
// host memory filled with 0xff bytes (NaN in f32 and bf16, -1 in integers) when allocated, so a
// kernel that reads what nobody wrote sees NaN; the calls check what a GPU checks (a copy's
// direction against where its pointers live, a free of something never allocated, a launch's
// configuration) and fail as the GPU would. Work is synchronous: a stream is a name, an event the
// host's clock.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "tests/cuda_emu/immortal.hpp"
#include "tests/cuda_emu/launch.hpp"

struct CUevent_st {
  double ms = 0;
};
struct CUstream_st {
  int id = 0;
};

namespace loom::cuda_emu {
namespace {

constexpr size_t kAlign = 256;
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr size_t kMaxSmem = 227 * 1024;
constexpr size_t kMemory = size_t(80) << 30;

struct State {
  std::mutex mu;
  std::map<const char*, size_t> device;  // allocation start -> bytes
  std::map<const char*, size_t> pinned;
  std::map<const void*, size_t> smem_limit;
  cudaError_t last = cudaSuccess;
  size_t in_use = 0;
};
State& state() {
  return loom::cuda_emu::immortal<State>();
}

bool inside(const std::map<const char*, size_t>& m, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = m.upper_bound(c);
  if (it == m.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second;
}
bool on_device(const void* p, size_t bytes) {
  return inside(state().device, p, bytes);
}

cudaError_t fail(cudaError_t e, const char* what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what);
  state().last = e;
  return e;
}

void* allocate(size_t bytes) {
  const size_t n = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, n == 0 ? kAlign : n);
  if (p) std::memset(p, 0xff, n == 0 ? kAlign : n);
  return p;
}

}  // namespace

bool launch_ok(const Config& c) {
  const uint64_t threads = uint64_t(c.block.x) * c.block.y * c.block.z;
  char why[200];
  if (threads == 0 || threads > 1024 || c.block.z > 64 || c.grid.x == 0 || c.grid.y == 0 ||
      c.grid.z == 0 || c.grid.x > 2147483647u || c.grid.y > 65535 || c.grid.z > 65535) {
    std::snprintf(why, sizeof why, "invalid launch: grid (%u, %u, %u), block (%u, %u, %u)",
                  c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z);
    fail(cudaErrorInvalidConfiguration, why);
    return false;
  }
  size_t limit = kDefaultSmem;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    for (const auto& [kernel, bytes] : state().smem_limit) limit = std::max(limit, bytes);
  }
  if (c.smem > limit) {
    std::snprintf(why, sizeof why,
                  "invalid launch: %zu bytes of dynamic shared memory, more than 48 KiB, and no "
                  "cudaFuncSetAttribute allowed as much",
                  c.smem);
    fail(cudaErrorInvalidValue, why);
    return false;
  }
  return true;
}

}  // namespace loom::cuda_emu

using loom::cuda_emu::fail;
using loom::cuda_emu::on_device;
using loom::cuda_emu::state;

extern "C" {

cudaError_t cudaMalloc(void** p, size_t bytes) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.in_use + bytes > loom::cuda_emu::kMemory) {
    *p = nullptr;
    s.last = cudaErrorMemoryAllocation;
    return cudaErrorMemoryAllocation;
  }
  *p = loom::cuda_emu::allocate(bytes);
  if (!*p) return s.last = cudaErrorMemoryAllocation;
  s.device[static_cast<const char*>(*p)] = bytes;
  s.in_use += bytes;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.device.find(static_cast<const char*>(p));
  if (it == s.device.end()) return fail(cudaErrorInvalidValue, "cudaFree of no allocation");
  s.in_use -= it->second;
  s.device.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *p = loom::cuda_emu::allocate(bytes);
  if (!*p) return s.last = cudaErrorMemoryAllocation;
  s.pinned[static_cast<const char*>(*p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  return cudaMallocHost(p, bytes);
}
cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.pinned.find(static_cast<const char*>(p));
  if (it == s.pinned.end()) return fail(cudaErrorInvalidValue, "cudaFreeHost of no allocation");
  s.pinned.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  if (bytes == 0) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    const bool d_dev = on_device(dst, bytes), s_dev = on_device(src, bytes);
    bool ok = true;
    switch (kind) {
      case cudaMemcpyHostToDevice:
        ok = d_dev && !s_dev;
        break;
      case cudaMemcpyDeviceToHost:
        ok = !d_dev && s_dev;
        break;
      case cudaMemcpyDeviceToDevice:
        ok = d_dev && s_dev;
        break;
      case cudaMemcpyHostToHost:
        ok = !d_dev && !s_dev;
        break;
      default:
        break;  // cudaMemcpyDefault: the pointers say (unified addressing)
    }
    // A device range that runs past its allocation is an error whatever the kind.
    auto partly = [](const void* p, size_t n) { return !on_device(p, n) && on_device(p, 1); };
    if (!ok || partly(dst, bytes) || partly(src, bytes))
      return fail(cudaErrorInvalidValue,
                  "cudaMemcpy: a pointer not where the kind says, or a "
                  "device range past its allocation");
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (bytes == 0) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    if (!on_device(p, bytes))
      return fail(cudaErrorInvalidValue, "cudaMemset outside device memory");
  }
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  return cudaMemsetAsync(p, value, bytes, nullptr);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s) {
  if (width > dpitch || width > spitch)
    return fail(cudaErrorInvalidPitchValue, "cudaMemcpy2D: a row wider than its pitch");
  for (size_t r = 0; r < height; ++r) {
    const cudaError_t e =
        cudaMemcpyAsync(static_cast<char*>(dst) + r * dpitch,
                        static_cast<const char*>(src) + r * spitch, width, kind, s);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int value, size_t width, size_t height,
                              cudaStream_t s) {
  if (width > pitch)
    return fail(cudaErrorInvalidPitchValue, "cudaMemset2D: a row wider than its pitch");
  for (size_t r = 0; r < height; ++r) {
    const cudaError_t e = cudaMemsetAsync(static_cast<char*>(p) + r * pitch, value, width, s);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  const cudaError_t e = state().last;
  state().last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  return state().last;
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    default:
      return "emulated error";
  }
}
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    default:
      return "cudaErrorUnknown";
  }
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  static CUstream_st stream{1};
  *s = &stream;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  return d == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice, "cudaSetDevice: one emulated GPU");
}
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d != 0) return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: one emulated GPU");
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "loom CUDA emulation (host)");
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = 132;
  p->totalGlobalMem = loom::cuda_emu::kMemory;
  p->l2CacheSize = 50 << 20;
  p->sharedMemPerBlock = loom::cuda_emu::kDefaultSmem;
  p->sharedMemPerBlockOptin = loom::cuda_emu::kMaxSmem;
  p->memoryBusWidth = 5120;
  p->maxThreadsPerBlock = 1024;
  p->warpSize = 32;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  switch (a) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *v = int(loom::cuda_emu::kMaxSmem);
      break;
    case cudaDevAttrMultiProcessorCount:
      *v = 132;
      break;
    case cudaDevAttrMaxThreadsPerBlock:
      *v = 1024;
      break;
    default:
      return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: not emulated");
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* id, int len, int) {
  std::snprintf(id, size_t(len), "emulated");
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  std::lock_guard<std::mutex> lock(state().mu);
  *total = loom::cuda_emu::kMemory;
  *free = *total - state().in_use;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* f, cudaFuncAttribute a, int value) {
  if (a != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute not emulated");
  if (value < 0 || size_t(value) > loom::cuda_emu::kMaxSmem)
    return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: more shared memory than 227 KiB");
  std::lock_guard<std::mutex> lock(state().mu);
  state().smem_limit[f] = size_t(value);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  static std::mutex mu;
  static std::map<int, CUevent_st> events;  // stable addresses
  std::lock_guard<std::mutex> lock(mu);
  *e = &events[int(events.size())];
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  e->ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = float(b->ms - a->ms);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) {
  return cudaSuccess;
}

}  // extern "C"
