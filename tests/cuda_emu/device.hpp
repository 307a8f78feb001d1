#pragma once
// The device side of the CUDA emulation: force-included (g++ -include) into each kernels/cuda/*.cu
// file of the emulated backend (cmake/cuda_emu.cmake), which g++ compiles as C++ after two textual
// rewrites (tests/cuda_emu/cu_to_cpp.cpp): a launch `k<<<grid, block, smem, stream>>>(args)`
// becomes `launch(Config(grid, block, smem, stream), [&](const auto&... a) { k(a...); }, args)`,
// and `extern __shared__ T name[];` becomes `T* name = dynamic_smem<T>();`. Everything else is the
// kernel files' own text: the CUDA keywords, built-in variables and intrinsics are defined here
// for the host, each CUDA thread a fiber of tests/cuda_emu/fibers.hpp (blocks one after another,
// __syncthreads a barrier, warp collectives exchanges), `__shared__` variables function statics
// (one block at a time; garbage before each block), device memory host memory
// (tests/cuda_emu/cudart.cpp). Under ASan and TSan it is memcheck and racecheck
// (scripts/cuda_emu_sanitize.sh).
//
// What it checks: the kernels' arithmetic, indexing, rounding points and synchronization
// (a missing barrier shows as stale shared memory under the lowest-first schedule, a divergent
// barrier or a warp collective that not all named lanes reach aborts), launch configurations (the
// GPU's limits: threads per block, grid dimensions; dynamic shared memory above 48 KiB only where
// cudaFuncSetAttribute raised some kernel's limit that far: which kernel's, the emulation cannot
// tell for a kernel template whose arguments the launch deduces). What it cannot: the GPU's own
// math library (expf, log1pf ... are glibc's here: within their ulp bounds of the device's),
// timing, occupancy, memory ordering between blocks that run concurrently on a GPU (here one after
// another).
#include <cuda_runtime.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tests/cuda_emu/fibers.hpp"
#include "tests/cuda_emu/launch.hpp"

// A kernel's static shared memory: function statics (one block runs at a time) in a section of
// their own, which tests/cuda_emu/fibers.hpp fills with garbage before each block.
#undef __shared__
#define __shared__ __attribute__((section("loom_cuda_shared"))) static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define threadIdx (::loom::cuda_emu::thread_idx())
#define blockIdx (::loom::cuda_emu::to_uint3(::loom::cuda_emu::g_block->block_idx))
#define blockDim (::loom::cuda_emu::to_dim3(::loom::cuda_emu::g_block->block_dim))
#define gridDim (::loom::cuda_emu::to_dim3(::loom::cuda_emu::g_block->grid_dim))
#define warpSize 32

namespace loom::cuda_emu {

inline uint3 to_uint3(Dim d) {
  return uint3{d.x, d.y, d.z};
}
inline dim3 to_dim3(Dim d) {
  return dim3(d.x, d.y, d.z);
}
inline uint3 thread_idx() {
  const Dim& b = g_block->block_dim;
  const unsigned t = unsigned(g_tid);
  return uint3{t % b.x, t / b.x % b.y, t / (b.x * b.y)};
}
template <class T>
T* dynamic_smem() {
  return reinterpret_cast<T*>(g_block->dynamic_smem);
}

template <class T>
uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t w = 0;
  std::memcpy(&w, &v, sizeof v);
  return w;
}
template <class T>
T from_bits(uint64_t w) {
  T v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
// Lane `src` of this warp's exchange (in `mask`, else the lane's own value: an out-of-range
// source lane returns the caller's value on a GPU; a source outside the mask is an error).
template <class T>
T shuffle(unsigned mask, T v, int src, bool in_range) {
  const int me = lane();
  uint64_t& mine = word(me);
  uint64_t* set = &mine - me;  // this collective's words (word() moves on after the barrier)
  mine = bits_of(v);
  warp_sync(mask);
  if (in_range && !((mask & warp_lanes()) >> src & 1u)) {
    std::fprintf(stderr, "cuda emulation: lane %d shuffles from lane %d, outside mask %08x\n", me,
                 src, mask);
    std::abort();
  }
  return in_range ? from_bits<T>(set[src]) : v;
}

}  // namespace loom::cuda_emu

// cuda_runtime.h's typed overload (nvcc's only).
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

// ---- intrinsics --------------------------------------------------------------------------------

inline void __syncthreads() {
  ::loom::cuda_emu::wait(::loom::cuda_emu::g_block->block);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::loom::cuda_emu::warp_sync(mask);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int me = ::loom::cuda_emu::lane(), src = me ^ lane_mask;
  return ::loom::cuda_emu::shuffle(mask, v, src, src / width == me / width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int me = ::loom::cuda_emu::lane(), src = me + int(delta);
  return ::loom::cuda_emu::shuffle(mask, v, src, src / width == me / width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int me = ::loom::cuda_emu::lane(), src = me - int(delta);
  return ::loom::cuda_emu::shuffle(mask, v, src, src >= 0 && src / width == me / width);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const int me = ::loom::cuda_emu::lane();
  return ::loom::cuda_emu::shuffle(mask, v, me / width * width + src_lane % width, true);
}
template <class T>
unsigned __match_any_sync(unsigned mask, T v) {
  namespace e = ::loom::cuda_emu;
  uint64_t& mine = e::word(e::lane());
  const uint64_t* set = &mine - e::lane();
  mine = e::bits_of(v);
  e::warp_sync(mask);
  const unsigned lanes = mask & e::warp_lanes();
  unsigned r = 0;
  for (int l = 0; l < e::kWarp; ++l)
    if ((lanes >> l & 1u) && set[l] == set[e::lane()]) r |= 1u << l;
  return r;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  namespace e = ::loom::cuda_emu;
  uint64_t& mine = e::word(e::lane());
  const uint64_t* set = &mine - e::lane();
  mine = pred != 0;
  e::warp_sync(mask);
  const unsigned lanes = mask & e::warp_lanes();
  unsigned r = 0;
  for (int l = 0; l < e::kWarp; ++l)
    if ((lanes >> l & 1u) && set[l]) r |= 1u << l;
  return r;
}
// CUDA's min and max of two numbers (device code calls them unqualified).
template <class A, class B>
requires std::is_arithmetic_v<A> && std::is_arithmetic_v<B> std::common_type_t<A, B> min(A a, B b) {
  using T = std::common_type_t<A, B>;
  return T(b) < T(a) ? T(b) : T(a);
}
template <class A, class B>
requires std::is_arithmetic_v<A> && std::is_arithmetic_v<B> std::common_type_t<A, B> max(A a, B b) {
  using T = std::common_type_t<A, B>;
  return T(a) < T(b) ? T(b) : T(a);
}

inline int __popc(unsigned x) {
  return std::popcount(x);
}
inline int __popcll(unsigned long long x) {
  return std::popcount(x);
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(unsigned(x));
}
inline unsigned __float_as_uint(float f) {
  return std::bit_cast<unsigned>(f);
}
inline float __uint_as_float(unsigned u) {
  return std::bit_cast<float>(u);
}
inline int __float_as_int(float f) {
  return std::bit_cast<int>(f);
}
inline float __int_as_float(int i) {
  return std::bit_cast<float>(i);
}
inline double __longlong_as_double(long long i) {
  return std::bit_cast<double>(i);
}
inline long long __double_as_longlong(double d) {
  return std::bit_cast<long long>(d);
}
// Round-to-nearest arithmetic that the device never contracts: the emulated backend is compiled
// with -ffp-contract=off, so these are the plain operations.
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  return a - b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline double __dadd_rn(double a, double b) {
  return a + b;
}
inline double __dsub_rn(double a, double b) {
  return a - b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
inline double __ddiv_rn(double a, double b) {
  return a / b;
}
inline double __fma_rn(double a, double b, double c) {
  return std::fma(a, b, c);
}
inline float __double2float_rn(double d) {
  return float(d);
}

// Atomics, relaxed as a GPU's: the fibers of the emulation never interleave within one call, but
// ThreadSanitizer must see them as atomic (atomics of two threads do not race; an atomic and a
// plain access to one address do).
namespace loom::cuda_emu {
template <class T, class F>
T atomic_update(T* p, F next_of) {
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T next = next_of(old);
  while (!__atomic_compare_exchange(p, &old, &next, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    next = next_of(old);
  return old;
}
}  // namespace loom::cuda_emu
template <class T>
T atomicAdd(T* p, std::type_identity_t<T> v) {
  return ::loom::cuda_emu::atomic_update(p, [v](T old) { return T(old + v); });
}
template <class T>
T atomicMin(T* p, std::type_identity_t<T> v) {
  return ::loom::cuda_emu::atomic_update(p, [v](T old) { return v < old ? v : old; });
}
template <class T>
T atomicMax(T* p, std::type_identity_t<T> v) {
  return ::loom::cuda_emu::atomic_update(p, [v](T old) { return v > old ? v : old; });
}
template <class T>
T atomicExch(T* p, std::type_identity_t<T> v) {
  return ::loom::cuda_emu::atomic_update(p, [v](T) { return v; });
}
template <class T>
T atomicCAS(T* p, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
  return ::loom::cuda_emu::atomic_update(p,
                                         [compare, v](T old) { return old == compare ? v : old; });
}
