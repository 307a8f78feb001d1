#pragma once
// A host emulation of the device primitives of kernels/cuda/flash_primitives.cuh, so that the
// flash attention kernel bodies (kernels/cuda/flash_attention_kernels.cuh) run on the CPU: each
// CUDA thread of a block is a fiber (ucontext) on the calling thread, the blocks of a grid run one
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
// after the other threads' waits, sees stale data. Single-threaded: one grid at a time.
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "core/dtype.hpp"

#define LOOM_FLASH_FN inline
#define LOOM_FLASH_UNROLL

namespace loom::flash {
namespace emu {

constexpr int kWarp = 32;

struct Copy {
  void* dst;
  const void* src;
  bool valid;
};

// A barrier of `size` fibers: the last to arrive releases the others.
struct Barrier {
  int size = 0, count = 0;
  uint64_t gen = 0;
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  const Barrier* waits = nullptr;  // the barrier this fiber waits on, and its generation
  uint64_t wait_gen = 0;
  std::vector<std::vector<Copy>> groups;  // committed, oldest first
  std::vector<Copy> open;                 // issued since the last commit
};

// The words a lane publishes for a warp collective.
struct Slot {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
  const void* addr;
  float f;
};

struct Block {
  int threads = 0;
  std::vector<Fiber> fibers;
  ucontext_t sched;
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<Slot> slots;
  std::function<void(int)> body;
};

inline Block* g_block = nullptr;
inline int g_tid = 0;

inline void yield() {
  swapcontext(&g_block->fibers[size_t(g_tid)].ctx, &g_block->sched);
}
inline void wait(Barrier& b) {
  const uint64_t gen = b.gen;
  if (++b.count == b.size) {
    b.count = 0;
    ++b.gen;
    return;
  }
  Fiber& f = g_block->fibers[size_t(g_tid)];
  f.waits = &b, f.wait_gen = gen;
  yield();  // the scheduler resumes this fiber once the barrier has moved on
  f.waits = nullptr;
}
inline void warp_sync() {
  wait(g_block->warps[size_t(g_tid / kWarp)]);
}
inline Slot& slot(int lane) {
  return g_block->slots[size_t(g_tid / kWarp * kWarp + lane)];
}
inline int lane() {
  return g_tid % kWarp;
}

inline void trampoline() {
  g_block->body(g_tid);
  g_block->fibers[size_t(g_tid)].done = true;
  // returns to uc_link (the scheduler)
}

// Runs body(tid) for tid 0..threads-1 as fibers of one block, round robin, until all return.
inline void run_block(int threads, std::function<void(int)> body) {
  static Block blk;
  blk.threads = threads;
  blk.body = std::move(body);
  blk.fibers.resize(size_t(threads));
  blk.block = Barrier{threads, 0, 0};
  blk.warps.assign(size_t((threads + kWarp - 1) / kWarp), Barrier{kWarp, 0, 0});
  blk.slots.assign(size_t(blk.warps.size() * kWarp), Slot{});
  g_block = &blk;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = blk.fibers[size_t(t)];
    f.stack.resize(256 * 1024);
    f.done = false;
    f.groups.clear();
    f.open.clear();
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &blk.sched;
    makecontext(&f.ctx, trampoline, 0);
  }
  // Always resume the lowest-numbered fiber that can run: warp 0 runs ahead as far as the next
  // block barrier before warp 1 starts, so a read of shared memory that another warp has not yet
  // written (a missing barrier), or a write over what a later warp has still to read, shows.
  for (;;) {
    int next = -1;
    bool all_done = true;
    for (int t = 0; t < threads && next < 0; ++t) {
      const Fiber& f = blk.fibers[size_t(t)];
      if (f.done) continue;
      all_done = false;
      if (!f.waits || f.waits->gen != f.wait_gen) next = t;
    }
    if (all_done) break;
    if (next < 0) {
      // Every fiber left waits on a barrier that some fiber passed by or finished without: the
      // kernel's barriers do not match.
      std::fprintf(stderr, "flash emulation: barrier deadlock (a barrier not reached by all)\n");
      std::abort();
    }
    g_tid = next;
    swapcontext(&blk.sched, &blk.fibers[size_t(next)].ctx);
  }
  g_block = nullptr;
}

// Runs a grid of gx x gy blocks of `threads`, one block after another; smem_bytes of zeroed shared
// memory per block.
inline void run_grid(int gx, int gy, int threads, size_t smem_bytes,
                     const std::function<void(int, int, int, char*)>& body) {
  std::vector<char> smem(smem_bytes + 16);
  char* base = smem.data() + (16 - reinterpret_cast<uintptr_t>(smem.data()) % 16) % 16;
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) {
      std::memset(base, 0x7f, smem_bytes);  // garbage (large values), never zeros
      run_block(threads, [&](int tid) { body(bx, by, tid, base); });
    }
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
