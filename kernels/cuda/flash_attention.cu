#include "kernels/cuda/flash_attention.hpp"

#include <cuda_runtime.h>

#include <climits>

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

using flash::kThreads;
using flash::kTile;
static_assert(kTile == kFlashTile, "scratch.hpp's tile (the planner's ranges) is the kernels'");

template <int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(const flash::FwdParams p) {
  extern __shared__ __align__(16) char smem[];
  flash::forward_block<D>(p, int(blockIdx.x), int(blockIdx.y), int(threadIdx.x), smem);
}
template <int D>
__global__ void __launch_bounds__(kThreads) backward_kv_kernel(const flash::BwdParams p) {
  extern __shared__ __align__(16) char smem[];
  flash::backward_kv_block<D>(p, int(blockIdx.x), int(blockIdx.y), int(threadIdx.x), smem);
}
template <int D>
__global__ void __launch_bounds__(kThreads) backward_q_kernel(const flash::BwdParams p) {
  extern __shared__ __align__(16) char smem[];
  flash::backward_q_block<D>(p, int(blockIdx.x), int(blockIdx.y), int(threadIdx.x), smem);
}
// One thread per tile: its [lo, hi] positions.
__global__ void tile_range_kernel(const int64_t* pos, int64_t n, int tiles, int64_t* rng) {
  const int t = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (t < tiles) flash::tile_range(pos, n, t, rng);
}

int tiles_of(int64_t n) {
  return int((n + kTile - 1) / kTile);
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

template <int D>
void forward(const flash::FwdParams& p, int64_t B, const char* op) {
  constexpr int bytes = flash::fwd_smem_bytes<D>();
  static const bool once = (allow_smem(forward_kernel<D>, bytes, op), true);
  (void)once;
  forward_kernel<D>
      <<<dim3(unsigned(p.q_tiles), unsigned(B * p.Hq)), kThreads, bytes, stream()>>>(p);
  check_launch(op);
}

template <int D>
void backward(const flash::BwdParams& p, int64_t B, const char* op) {
  constexpr int kv_bytes = flash::bwd_kv_smem_bytes<D>(), q_bytes = flash::bwd_q_smem_bytes<D>();
  static const bool once = (allow_smem(backward_kv_kernel<D>, kv_bytes, op),
                            allow_smem(backward_q_kernel<D>, q_bytes, op), true);
  (void)once;
  backward_kv_kernel<D>
      <<<dim3(unsigned(p.k_tiles), unsigned(B * p.Hkv)), kThreads, kv_bytes, stream()>>>(p);
  check_launch(op);
  backward_q_kernel<D>
      <<<dim3(unsigned(p.q_tiles), unsigned(B * p.Hq)), kThreads, q_bytes, stream()>>>(p);
  check_launch(op);
}

const uint16_t* bits(const bf16* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

}  // namespace

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
  if (s.D == 64)
    forward<64>(p, s.B, op);
  else
    forward<128>(p, s.B, op);
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
  if (s.D == 64)
    backward<64>(p, s.B, op);
  else
    backward<128>(p, s.B, op);
}

}  // namespace loom::cuda
