#pragma once
// The device primitives of the flash attention kernels (flash_attention_kernels.cuh) on the GPU:
// warp-wide tensor core products (mma.sync m16n8k16 bf16 -> f32), shared-memory matrix loads
// (ldmatrix, plain and transposed), asynchronous 16-byte copies global -> shared (cp.async, with
// zero fill) and their waits, the block barrier, the warp shuffle, and the scalar math whose
// rounding the kernels rely on. tests/kernels/flash_emulation.hpp defines the same functions for
// the CPU (each CUDA thread a fiber), so the same kernel bodies run, and are checked, on hosts
// without a GPU: a primitive added here needs its emulation there.
#include <cstdint>

#define LOOM_FLASH_FN __device__ __forceinline__
#define LOOM_FLASH_UNROLL _Pragma("unroll")

namespace loom::flash {

LOOM_FLASH_FN uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8j..8j+7 give the row addresses of matrix j, register j of lane l
// receives row l/4, elements 2(l%4), 2(l%4)+1 of matrix j (.trans: row 2(l%4) and 2(l%4)+1 of
// column l/4).
LOOM_FLASH_FN void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
LOOM_FLASH_FN void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// d += A B for one 16x8 tile: A 16x16 (row major, 4 registers of 2 bf16), B 16x8 (column major,
// 2 registers), d 16x8 f32 (4 registers).
LOOM_FLASH_FN void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, bypassing L1; valid false writes 16 zero bytes (src-size 0: nothing
// is read, src must still be a mapped address).
LOOM_FLASH_FN void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
LOOM_FLASH_FN void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
LOOM_FLASH_FN void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

LOOM_FLASH_FN void block_sync() {
  __syncthreads();
}
LOOM_FLASH_FN float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

// The scalar math, as the CPU kernels round it: a product rounded on its own (never contracted
// into an FMA with the next operation), exp2f and log2f.
LOOM_FLASH_FN float mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}
LOOM_FLASH_FN float exp2_(float x) {
  return exp2f(x);
}
LOOM_FLASH_FN float log2_(float x) {
  return log2f(x);
}
// Two floats rounded to bf16 (nearest even) in one word, lo in the low half (cvt puts its first
// source in the upper half).
LOOM_FLASH_FN uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

}  // namespace loom::flash
