#include "kernels/cuda/flash_attention.hpp"

#include <cuda_runtime.h>

#include <climits>
#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cuda/cast.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/flash_primitives.cuh"
#include "kernels/cuda/runtime.hpp"
#include "kernels/cuda/scratch.hpp"
#include "kernels/cuda/vec.cuh"
// The bodies, after the primitives they call.
#include "kernels/cuda/flash_attention_kernels.cuh"

namespace loom::cuda {
namespace {

using flash::kThreadsOf;
using flash::kTile;
static_assert(kTile == kFlashTile, "scratch.hpp's tile (the planner's ranges) is the kernels'");

template <int D, int W>
__global__ void __launch_bounds__(kThreadsOf<W>) forward_kernel(const flash::FwdParams p) {
  extern __shared__ __align__(16) char smem[];
  flash::forward_block<D, W>(p, int(blockIdx.x), int(blockIdx.y), int(threadIdx.x), smem);
}
template <int D, int W>
__global__ void __launch_bounds__(kThreadsOf<W>) backward_kv_kernel(const flash::BwdParams p) {
  extern __shared__ __align__(16) char smem[];
  flash::backward_kv_block<D, W>(p, int(blockIdx.x), int(blockIdx.y), int(threadIdx.x), smem);
}
template <int D, int W>
__global__ void __launch_bounds__(kThreadsOf<W>) backward_q_kernel(const flash::BwdParams p) {
  extern __shared__ __align__(16) char smem[];
  flash::backward_q_block<D, W>(p, int(blockIdx.x), int(blockIdx.y), int(threadIdx.x), smem);
}
// One thread per tile: its [lo, hi] positions.
__global__ void tile_range_kernel(const int64_t* pos, int64_t n, int tiles, int64_t* rng) {
  const int t = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (t < tiles) flash::tile_range(pos, n, t, rng);
}

int tiles_of(int64_t n) {
  return int((n + kTile - 1) / kTile);
}

// Warps per block: LOOM_FLASH_WARPS (read once) = 4 or 8 for every call, or auto: 8 at head dim
// 128 and 4 at 64. Measured by nvcc's register counts (sm_90a: about 240 a thread at D = 128, 166
// in the forward and dK/dV at D = 64) and the blocks' shared memory: at D = 128 an SM holds 8
// warps either way, so the 128-row block reads each key (query) tile once for twice the rows; at
// D = 64 it holds 12 warps of 64-row blocks but only 8 of 128-row ones, a trade the benchmark
// (bench/compare_attention_gpu.py runs both) settles on a GPU.
struct Warps {
  int forced = 0;  // 0: auto
  std::string why;
};
const Warps& warps() {
  static const Warps w = [] {
    const char* env = std::getenv("LOOM_FLASH_WARPS");
    const std::string v = env && *env ? env : "auto";
    LOOM_CHECK(v == "auto" || v == "4" || v == "8", "LOOM_FLASH_WARPS='", v,
               "' is not a block size of the flash attention kernels; expected auto, 4 or 8");
    Warps r;
    if (v == "auto") {
      r.why = "8 warps (128-row blocks) at head dim 128, 4 (64 rows) at 64 (LOOM_FLASH_WARPS=auto)";
    } else {
      r.forced = std::stoi(v);
      r.why = v + " warps (" + std::to_string(16 * r.forced) +
              "-row blocks) at every head dim (LOOM_FLASH_WARPS=" + v + ")";
    }
    return r;
  }();
  return w;
}
int warps_for(int64_t D) {
  return warps().forced ? warps().forced : D == 128 ? 8 : 4;
}

// Kernels whose shared memory passes the default 48 KiB say so once.
template <class K>
void allow_smem(K kernel, int bytes, const char* op) {
  if (bytes > 48 * 1024)
    LOOM_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), op);
}

// The per-tile position ranges of a block call (none for plain causal attention): [lo, hi] for
// the query tiles, then the key tiles, in `buf`.
struct Ranges {
  Tensor buf;
  const int64_t *q = nullptr, *k = nullptr;
};
Ranges ranges(const cpu::BlockShape& s, const int64_t* q_pos, const int64_t* k_pos,
              const char* op) {
  Ranges r;
  if (!q_pos) return r;
  const int qt = tiles_of(s.Tq), kt = tiles_of(s.Tk);
  // int64 as pairs of int32 (the tensors have no int64 type).
  r.buf = Tensor::empty({4 * int64_t(qt + kt)}, DType::i32, Device::cuda);
  int64_t* p = static_cast<int64_t*>(r.buf.raw());
  tile_range_kernel<<<unsigned((qt + 127) / 128), 128, 0, stream()>>>(q_pos, s.Tq, qt, p);
  tile_range_kernel<<<unsigned((kt + 127) / 128), 128, 0, stream()>>>(k_pos, s.Tk, kt, p + 2 * qt);
  check_launch(op);
  r.q = p, r.k = p + 2 * qt;
  return r;
}

// What the kernels need beyond attention.cu's shape checks: usable operands, positions for both
// sides or neither, grids within one launch.
void check_call(const cpu::BlockShape& s, const void* q, const void* k, const void* v,
                const int64_t* q_pos, const int64_t* k_pos, const char* op) {
  LOOM_CHECK(flash_attention_usable(s.D, s.q_stride, s.kv_stride, q, k, v), op, ": D = ", s.D,
             " (64 or 128), q_stride ", s.q_stride, ", kv_stride ", s.kv_stride,
             " (multiples of 8) or q, k, v not 16-byte aligned");
  LOOM_CHECK((q_pos == nullptr) == (k_pos == nullptr) && (q_pos || s.Tq == s.Tk), op,
             ": q_pos and k_pos both set, or both null with Tq = Tk");
  LOOM_CHECK(s.B * s.Hq <= 65535, op, ": B*Hq = ", s.B * s.Hq,
             ", more than one launch's grid.y (65535)");
  LOOM_CHECK(s.Tq <= INT_MAX && s.Tk <= INT_MAX, op, ": Tq = ", s.Tq, ", Tk = ", s.Tk,
             ", more than one launch covers");
}

template <int D, int W>
void forward(const flash::FwdParams& p, int64_t B, const char* op) {
  constexpr int bytes = flash::fwd_smem_bytes<D, W>();
  static const bool once = (allow_smem(forward_kernel<D, W>, bytes, op), true);
  (void)once;
  forward_kernel<D, W><<<dim3(unsigned(flash::blocks_of<W>(p.q_tiles)), unsigned(B * p.Hq)),
                         kThreadsOf<W>, bytes, stream()>>>(p);
  check_launch(op);
}

template <int D, int W>
void backward(const flash::BwdParams& p, int64_t B, const char* op) {
  constexpr int kv_bytes = flash::bwd_kv_smem_bytes<D, W>();
  constexpr int q_bytes = flash::bwd_q_smem_bytes<D, W>();
  static const bool once = (allow_smem(backward_kv_kernel<D, W>, kv_bytes, op),
                            allow_smem(backward_q_kernel<D, W>, q_bytes, op), true);
  (void)once;
  backward_kv_kernel<D, W><<<dim3(unsigned(flash::blocks_of<W>(p.k_tiles)), unsigned(B * p.Hkv)),
                             kThreadsOf<W>, kv_bytes, stream()>>>(p);
  check_launch(op);
  backward_q_kernel<D, W><<<dim3(unsigned(flash::blocks_of<W>(p.q_tiles)), unsigned(B * p.Hq)),
                            kThreadsOf<W>, q_bytes, stream()>>>(p);
  check_launch(op);
}

// The instance of the head dim (64 or 128) and its block size (warps_for).
void forward_of(int64_t D, const flash::FwdParams& p, int64_t B, const char* op) {
  const bool w8 = warps_for(D) == 8;
  if (D == 64)
    w8 ? forward<64, 8>(p, B, op) : forward<64, 4>(p, B, op);
  else
    w8 ? forward<128, 8>(p, B, op) : forward<128, 4>(p, B, op);
}
void backward_of(int64_t D, const flash::BwdParams& p, int64_t B, const char* op) {
  const bool w8 = warps_for(D) == 8;
  if (D == 64)
    w8 ? backward<64, 8>(p, B, op) : backward<64, 4>(p, B, op);
  else
    w8 ? backward<128, 8>(p, B, op) : backward<128, 4>(p, B, op);
}

const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

}  // namespace

std::string flash_attention_blocks() {
  return warps().why;
}

bool flash_attention_supported(int64_t D) {
  return flash_head_dim(D);
}

bool flash_attention_usable(int64_t D, int64_t q_stride, int64_t kv_stride, const void* q,
                            const void* k, const void* v) {
  return flash_attention_supported(D) && q_stride % 8 == 0 && kv_stride % 8 == 0 && aligned16(q) &&
         aligned16(k) && aligned16(v);
}

void flash_attention_forward_bf16(const cpu::BlockShape& s, const bf16* q, const bf16* k,
                                  const bf16* v, const int64_t* q_pos, const int64_t* k_pos,
                                  float* out_f32, bf16* out_bf16, float* lse) {
  const char* op = "flash_attention_forward_bf16";
  check_call(s, q, k, v, q_pos, k_pos, op);
  LOOM_CHECK((out_f32 == nullptr) != (out_bf16 == nullptr), op,
             ": exactly one of out_f32, out_bf16");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(out_bf16) % 4 == 0, op,
             ": out_bf16 not 4-byte aligned (pairs are stored as one word)");
  const Ranges r = ranges(s, q_pos, k_pos, op);
  flash::FwdParams p{};
  p.q = bits(q), p.k = bits(k), p.v = bits(v);
  p.q_pos = q_pos, p.k_pos = k_pos, p.q_rng = r.q, p.k_rng = r.k;
  p.out_f32 = out_f32, p.out_bf16 = reinterpret_cast<uint16_t*>(out_bf16), p.lse = lse;
  p.Tq = s.Tq, p.Tk = s.Tk, p.Hq = s.Hq, p.Hkv = s.Hkv;
  p.q_stride = s.q_stride, p.kv_stride = s.kv_stride;
  p.c = s.scale * flash::kLog2e;
  p.q_tiles = tiles_of(s.Tq), p.k_tiles = tiles_of(s.Tk);
  forward_of(s.D, p, s.B, op);
}

void flash_attention_backward_bf16(const cpu::BlockShape& s, const bf16* q, const bf16* k,
                                   const bf16* v, const int64_t* q_pos, const int64_t* k_pos,
                                   const float* lse, const float* delta, const float* dout,
                                   float* dq, float* dk, float* dv) {
  const char* op = "flash_attention_backward_bf16";
  check_call(s, q, k, v, q_pos, k_pos, op);
  const Ranges r = ranges(s, q_pos, k_pos, op);
  // dO as the products read it: rounded to bf16 once (16-byte rows: Hq*D is a multiple of 8).
  Tensor dob = Tensor::empty({s.B * s.Tq * s.Hq * s.D}, DType::bf16, Device::cuda);
  cast_f32_to_bf16(dout, dob.data<bf16>(), s.B * s.Tq * s.Hq * s.D);
  flash::BwdParams p{};
  p.q = bits(q), p.k = bits(k), p.v = bits(v), p.dout = bits(dob.data<bf16>());
  p.q_pos = q_pos, p.k_pos = k_pos, p.q_rng = r.q, p.k_rng = r.k;
  p.lse = lse, p.delta = delta, p.dq = dq, p.dk = dk, p.dv = dv;
  p.Tq = s.Tq, p.Tk = s.Tk, p.Hq = s.Hq, p.Hkv = s.Hkv;
  p.q_stride = s.q_stride, p.kv_stride = s.kv_stride;
  p.c = s.scale * flash::kLog2e, p.scale = s.scale;
  p.accumulate = s.accumulate;
  p.q_tiles = tiles_of(s.Tq), p.k_tiles = tiles_of(s.Tk);
  backward_of(s.D, p, s.B, op);
}

}  // namespace loom::cuda
