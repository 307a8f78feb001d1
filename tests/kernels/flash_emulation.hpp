#pragma once
// A host emulation of the device primitives of kernels/cuda/flash_primitives.cuh, so that the
// flash attention kernel bodies (kernels/cuda/flash_attention_kernels.cuh) run on the CPU: each
// CUDA thread of a block is a fiber on the calling thread, the blocks of a grid run one
// after another, __syncthreads is a barrier of the block's fibers, and each warp collective
// (shuffle, mma, ldmatrix) is an exchange: every lane publishes its operand, a warp barrier, every
// lane reads what it receives, a warp barrier. A barrier that some fiber never reaches (a
// divergent __syncthreads, a warp collective outside converged code) fails instead of hanging.
//
// The fragment layouts are the point: they follow the PTX ISA (NVIDIA, "Parallel Thread Execution
// ISA", section "Matrix Fragments for mma.m16n8k16 with floating point type", and the ldmatrix
// instruction's description: "addresses addr0-addr7 correspond to the rows of the first matrix,
// addr8-addr15 to the second", "a group of four threads loads an entire row", ".trans indicates
// that the matrix is loaded in column-major format"), as public copies of the ISA text and kernels
// that use the instructions state them. For lane l, groupID g = l / 4, threadID_in_group t = l % 4:
//   A (16x16 bf16, .row): a0,a1 = (g, 2t), (g, 2t+1); a2,a3 = (g+8, 2t..); a4,a5 = (g, 2t+8..);
//                          a6,a7 = (g+8, 2t+8..); register i holds a(2i), a(2i+1), low half first.
//   B (16x8 bf16, .col):   b0,b1 = (2t, g), (2t+1, g); b2,b3 = (2t+8, g), (2t+9, g).
//   C, D (16x8 f32):       c0,c1 = (g, 2t), (g, 2t+1); c2,c3 = (g+8, 2t), (g+8, 2t+1).
//   ldmatrix .x4 (8x8 b16 matrices): lanes 8j..8j+7 give the addresses of rows 0..7 of matrix j;
//   register j of lane l holds row l/4, elements 2(l%4), 2(l%4)+1 of matrix j; with .trans, the
//   elements (row 2(l%4), column l/4) and (row 2(l%4)+1, column l/4).
// The products sum in f32 in k order (the tensor cores' order and internal precision are not
// specified; the tests' tolerances cover the difference).
//
// cp.async copies are queued per thread and carried out at the thread's cp.async.wait_group that
// retires their group (nothing lands early), so a read before the wait, or before the barrier
// after the other threads' waits, sees stale data. The fibers, barriers and warp exchanges are
// tests/cuda_emu/fibers.hpp's.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

#include "core/dtype.hpp"
#include "tests/cuda_emu/fibers.hpp"

#ifndef LOOM_FLASH_FN
#define LOOM_FLASH_FN inline
#define LOOM_FLASH_UNROLL
#endif

namespace loom::flash {
namespace emu {

using namespace loom::cuda_emu;

// Runs a grid of gx x gy blocks of `threads` (body(bx, by, tid, smem)), one block after another;
// smem_bytes of shared memory per block, garbage before each block.
inline void run_grid(int gx, int gy, int threads, size_t smem_bytes,
                     const std::function<void(int, int, int, char*)>& body) {
  cuda_emu::run_grid(Dim{unsigned(gx), unsigned(gy), 1}, Dim{unsigned(threads), 1, 1}, smem_bytes,
                     [&](int tid) {
                       const Block& b = *g_block;
                       body(int(b.block_idx.x), int(b.block_idx.y), tid, b.dynamic_smem);
                     });
}

inline uint16_t bf16_bits(float f) {
  return float_to_bf16(f).bits;
}
inline float bf16_value(uint16_t b) {
  return bf16_to_float(bf16{b});
}

}  // namespace emu

// ---- the primitives ----------------------------------------------------------------------------

inline void block_sync() {
  emu::wait(emu::g_block->block);
}

inline float shfl_xor(float v, int mask) {
  emu::slot(emu::lane()).f = v;
  emu::warp_sync();
  const float r = emu::slot(emu::lane() ^ mask).f;
  emu::warp_sync();
  return r;
}

inline void ldmatrix_impl(uint32_t (&r)[4], const void* row, bool trans) {
  const int l = emu::lane();
  emu::slot(l).addr = row;
  emu::warp_sync();
  auto elem = [](int j, int row_i, int col) {
    const uint16_t* p = static_cast<const uint16_t*>(emu::slot(8 * j + row_i).addr);
    return uint32_t(p[col]);
  };
  for (int j = 0; j < 4; ++j) {
    if (!trans)
      r[j] = elem(j, l / 4, 2 * (l % 4)) | (elem(j, l / 4, 2 * (l % 4) + 1) << 16);
    else
      r[j] = elem(j, 2 * (l % 4), l / 4) | (elem(j, 2 * (l % 4) + 1, l / 4) << 16);
  }
  emu::warp_sync();
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  ldmatrix_impl(r, row, false);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  ldmatrix_impl(r, row, true);
}

inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int l = emu::lane();
  emu::Slot& me = emu::slot(l);
  std::memcpy(me.a, a, sizeof me.a);
  me.b[0] = b0, me.b[1] = b1;
  std::memcpy(me.c, d, sizeof me.c);
  emu::warp_sync();
  auto half = [](uint32_t w, int k) { return emu::bf16_value(uint16_t(k % 2 ? w >> 16 : w)); };
  // A(row, k): lane (row % 8) * 4 + (k % 8) / 2, register row / 8 + 2 (k / 8), half k % 2.
  auto A = [&](int row, int k) {
    return half(emu::slot((row % 8) * 4 + (k % 8) / 2).a[row / 8 + 2 * (k / 8)], k);
  };
  // B(k, n): lane n * 4 + (k % 8) / 2, register k / 8, half k % 2.
  auto B = [&](int k, int n) { return half(emu::slot(n * 4 + (k % 8) / 2).b[k / 8], k); };
  const int g = l / 4, t = l % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float acc = me.c[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  emu::warp_sync();
  std::memcpy(d, out, sizeof out);
}

inline void cp_async16(void* dst, const void* src, bool valid) {
  emu::g_block->fibers[size_t(emu::g_tid)].open.push_back({dst, src, valid});
}
inline void cp_async_commit() {
  emu::Fiber& f = emu::g_block->fibers[size_t(emu::g_tid)];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
template <int N>
inline void cp_async_wait() {
  emu::Fiber& f = emu::g_block->fibers[size_t(emu::g_tid)];
  while (f.groups.size() > size_t(N)) {
    for (const emu::Copy& c : f.groups.front()) {
      if (c.valid)
        std::memcpy(c.dst, c.src, 16);
      else
        std::memset(c.dst, 0, 16);
    }
    f.groups.erase(f.groups.begin());
  }
}

// volatile: the product is rounded on its own, never contracted into an FMA with what follows.
inline float mul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float exp2_(float x) {
  return std::exp2(x);
}
inline float log2_(float x) {
  return std::log2(x);
}
inline uint32_t pack_bf16(float lo, float hi) {
  return uint32_t(emu::bf16_bits(lo)) | (uint32_t(emu::bf16_bits(hi)) << 16);
}

}  // namespace loom::flash
