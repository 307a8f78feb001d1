#pragma once
// The CPU's stand-in for a GPU's thread blocks, shared by the host emulations of the CUDA kernels
// (tests/cuda_emu/device.hpp for every kernel of kernels/cuda, tests/kernels/flash_emulation.hpp
// for the flash kernels' tensor-core primitives): each CUDA thread of a block is a fiber (its own
// stack) on the calling thread, the blocks of a grid run one after another, __syncthreads is a
// barrier of the block's fibers and each warp collective an exchange (every lane publishes its
// operand, a warp barrier, every lane reads what it receives, a warp barrier). A barrier that some
// fiber never reaches (a divergent __syncthreads, a warp collective outside converged code) aborts
// instead of hanging.
//
// The scheduler always resumes the lowest-numbered fiber that can run (or, with
// LOOM_CUDA_EMU_ORDER=reverse, the highest): one warp runs ahead as far as the next barrier before
// the others start, so a read of shared memory another warp has not yet written (a missing
// barrier), or a write over what a later warp has still to read, shows. Single-threaded: one grid
// at a time.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define LOOM_CUDA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_CUDA_EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define LOOM_CUDA_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LOOM_CUDA_EMU_TSAN 1
#endif
#endif
#ifdef LOOM_CUDA_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef LOOM_CUDA_EMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif
// A function TSan does not instrument (no accesses recorded, no call-stack entry).
#ifdef LOOM_CUDA_EMU_TSAN
#define LOOM_CUDA_EMU_UNTRACKED __attribute__((no_sanitize("thread"), noinline))
#else
#define LOOM_CUDA_EMU_UNTRACKED
#endif

// The context switch: the callee-saved registers and the x87/SSE control words pushed on the
// running stack, its pointer saved, the other stack's popped (glibc's swapcontext also saves the
// signal mask, a system call per switch: the emulation switches at every barrier of every
// thread). x86-64 System V only, as loom. Weak: each translation unit that includes this header
// defines it, the linker keeps one.
extern "C" void loom_cuda_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .weak loom_cuda_emu_switch
  .type loom_cuda_emu_switch, @function
loom_cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size loom_cuda_emu_switch, .-loom_cuda_emu_switch
  .popsection
)");

namespace loom::cuda_emu {

constexpr int kWarp = 32;

struct Copy {  // a cp.async copy waiting for its group's wait
  void* dst;
  const void* src;
  bool valid;
};

// A stack to run on: the scheduler's (the calling thread's) or a fiber's.
struct Context {
  void* sp = nullptr;            // the saved stack pointer while switched out
  const void* bottom = nullptr;  // the stack's lowest address and its size (ASan)
  size_t size = 0;
  void* fake_stack = nullptr;  // ASan's fake stack while switched out
  void* tsan = nullptr;        // the TSan fiber (thread) it is
};

// Switches from the running context to `to`; `from_ends`: the running one never resumes.
// Untracked, as trampoline: TSan keeps each fiber's call stack from the instrumented functions'
// entries and exits, and these two never return when a fiber ends (the next block reuses the
// fiber, so its stack would grow by them every block).
LOOM_CUDA_EMU_UNTRACKED inline void switch_context(Context& from, const Context& to,
                                                   [[maybe_unused]] bool from_ends = false) {
#ifdef LOOM_CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(from_ends ? nullptr : &from.fake_stack, to.bottom, to.size);
#endif
#ifdef LOOM_CUDA_EMU_TSAN
  __tsan_switch_to_fiber(to.tsan, __tsan_switch_to_fiber_no_sync);
#endif
  loom_cuda_emu_switch(&from.sp, to.sp);
#ifdef LOOM_CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(from.fake_stack, nullptr, nullptr);
#endif
}

// TSan's happens-before edges: what the running context did before release(token) happens before
// what a context does after acquire(token).
inline void release([[maybe_unused]] const void* token) {
#ifdef LOOM_CUDA_EMU_TSAN
  __tsan_release(const_cast<void*>(token));
#endif
}
inline void acquire([[maybe_unused]] const void* token) {
#ifdef LOOM_CUDA_EMU_TSAN
  __tsan_acquire(const_cast<void*>(token));
#endif
}
// While an Untracked lives, TSan does not record the running context's accesses (nor those of a
// function marked LOOM_CUDA_EMU_UNTRACKED): the emulation's own bookkeeping, which the scheduler
// and the fibers share without barriers.
struct Untracked {
  Untracked() {
#ifdef LOOM_CUDA_EMU_TSAN
    __tsan_ignore_thread_begin();
#endif
  }
  ~Untracked() {
#ifdef LOOM_CUDA_EMU_TSAN
    __tsan_ignore_thread_end();
#endif
  }
  Untracked(const Untracked&) = delete;
  Untracked& operator=(const Untracked&) = delete;
};

// A barrier of `size` fibers: the last to arrive releases the others. `lowest` is the lowest
// scheduling position among its fibers (the scheduler's scan starts there again on a release).
struct Barrier {
  int size = 0, count = 0;
  uint64_t gen = 0;
  int lowest = 0;
};

struct Fiber {
  Context ctx;
  std::unique_ptr<char[]> stack;
  std::string name;  // TSan's name of it
  bool done = false;
  const Barrier* waits = nullptr;  // the barrier this fiber waits on, and its generation
  uint64_t wait_gen = 0;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;                 // issued since the last commit
};

// The words a lane publishes for a warp collective.
struct Slot {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
  const void* addr;
  float f;
  uint64_t word;  // a shuffled or matched value's bits
  uint32_t mask;  // the mask the lane named
};

struct Dim {
  unsigned x = 1, y = 1, z = 1;
};

struct Block {
  int threads = 0;
  Dim block_dim, block_idx, grid_dim;
  std::vector<Fiber> fibers;
  Context sched;
  char start = 0, end = 0;  // TSan's tokens: the scheduler's setup before a block, the block's end
  int scan_from = 0;        // no fiber below this one can run (a barrier's release lowers it)
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<Slot> slots;
  std::vector<uint64_t> words;  // a word per lane, twice: shuffles alternate (one barrier each)
  std::function<void(int)> body;
  char* dynamic_smem = nullptr;
};

inline Block* g_block = nullptr;
inline int g_tid = 0;

inline void yield() {
  switch_context(g_block->fibers[size_t(g_tid)].ctx, g_block->sched);
}
// The barrier's bookkeeping for this fiber's arrival: true for the last to arrive (which releases
// the others), else the fiber is marked as waiting on it. Untracked by TSan, which a function
// attribute does at no cost (its ignore regions record a stack each).
LOOM_CUDA_EMU_UNTRACKED inline bool arrive(Barrier& b, Fiber& f) {
  const uint64_t gen = b.gen;
  if (++b.count == b.size) {
    b.count = 0;
    ++b.gen;
    if (b.lowest < g_block->scan_from) g_block->scan_from = b.lowest;  // it released those
    return true;
  }
  f.waits = &b, f.wait_gen = gen;
  return false;
}
LOOM_CUDA_EMU_UNTRACKED inline void leave(Fiber& f) {
  f.waits = nullptr;
}
inline void wait(Barrier& b) {
  // TSan: this fiber's accesses so far happen before what every fiber of the barrier does after
  // it (each arrival releases, each departure acquires).
  release(&b);
  Fiber& f = g_block->fibers[size_t(g_tid)];
  if (!arrive(b, f)) {
    yield();  // the scheduler resumes this fiber once the barrier has moved on
    leave(f);
  }
  acquire(&b);
}
inline int lane() {
  return g_tid % kWarp;
}
// The lanes of this fiber's warp that exist (the last warp of a block may be partial).
inline uint32_t warp_lanes() {
  const int first = g_tid / kWarp * kWarp;
  const int n = g_block->threads - first < kWarp ? g_block->threads - first : kWarp;
  return n == kWarp ? 0xffffffffu : (1u << n) - 1;
}
// A barrier of the warp's lanes named in `mask` (all of the warp's by default). A lane that calls
// a collective with a mask that leaves itself out, or lanes of one collective naming different
// masks, is undefined behaviour on a GPU: an error here.
inline void warp_sync(uint32_t mask = 0xffffffffu) {
  mask &= warp_lanes();
  if (!(mask >> lane() & 1u)) {
    std::fprintf(stderr, "cuda emulation: lane %d calls a warp collective with mask %08x\n", lane(),
                 mask);
    std::abort();
  }
  Barrier& b = g_block->warps[size_t(g_tid / kWarp)];
  if (b.count == 0) b.size = __builtin_popcount(mask);
  wait(b);
}
inline Slot& slot(int lane) {
  return g_block->slots[size_t(g_tid / kWarp * kWarp + lane)];
}
// The word `lane` of this warp publishes for the warp's next collective: two sets used in turn
// (by the warp barrier's generation), so a collective needs one barrier, not two: a lane that
// runs ahead to the next collective writes the other set, and the one after that waits for the
// barrier every lane reaches only once it has read this one.
inline uint64_t& word(int lane) {
  const size_t w = size_t(g_tid / kWarp);
  return g_block
      ->words[(g_block->warps[w].gen & 1) * g_block->slots.size() + w * kWarp + size_t(lane)];
}

LOOM_CUDA_EMU_UNTRACKED inline void finish(Fiber& f) {
  f.done = true;
}

// A fiber's first frame: runs the body, then switches back to the scheduler for good.
[[noreturn]] LOOM_CUDA_EMU_UNTRACKED inline void trampoline() {
#ifdef LOOM_CUDA_EMU_ASAN
  // The first switch into a fiber ends here: ASan learns the scheduler's stack from it.
  __sanitizer_finish_switch_fiber(nullptr, &g_block->sched.bottom, &g_block->sched.size);
#endif
  acquire(&g_block->start);
  g_block->body(g_tid);
  release(&g_block->end);
  Fiber& f = g_block->fibers[size_t(g_tid)];
  finish(f);
  switch_context(f.ctx, g_block->sched, true);
  std::abort();  // never resumed
}

// A fresh stack whose first switch "returns" into trampoline: six zeroed callee-saved registers,
// the current control words, the return address at a 16-byte boundary (so the entry sees the
// stack as after a call).
inline void* fresh_stack(char* base, size_t bytes) {
#ifdef LOOM_CUDA_EMU_ASAN
  // The frames a fiber ends in (trampoline's, the switch's) never return, so their redzones stay
  // poisoned on the stack the next block's fiber reuses: cleared here (their depth is far less).
  constexpr size_t kEndFrames = 16 * 1024;
  ASAN_UNPOISON_MEMORY_REGION(base + bytes - kEndFrames, kEndFrames);
#endif
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + bytes) & ~uintptr_t(15);
  top -= 16;  // a null "return address" of trampoline's frame, and the alignment
  auto* ret = reinterpret_cast<void**>(top);
  ret[0] = reinterpret_cast<void*>(&trampoline);
  ret[1] = nullptr;
  auto* regs = reinterpret_cast<uint64_t*>(top) - 6;
  for (int i = 0; i < 6; ++i) regs[i] = 0;
  auto* csr = reinterpret_cast<uint32_t*>(regs) - 2;
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(*reinterpret_cast<uint16_t*>(&csr[1])));
  return csr;
}

inline bool reverse_order() {
  static const bool r = [] {
    const char* v = std::getenv("LOOM_CUDA_EMU_ORDER");
    return v && std::strcmp(v, "reverse") == 0;
  }();
  return r;
}

// Runs body(tid) for tid 0..threads-1 as the fibers of one block until all return.
inline void run_block(Block& blk, int threads, std::function<void(int)> body) {
  constexpr size_t kStack = 256 * 1024;  // touched pages only
  const Untracked u;
  blk.threads = threads;
  blk.body = std::move(body);
  if (blk.fibers.size() < size_t(threads)) blk.fibers.resize(size_t(threads));
  const bool rev = reverse_order();
  blk.block = Barrier{threads, 0, 0, 0};
  blk.warps.assign(size_t((threads + kWarp - 1) / kWarp), Barrier{kWarp, 0, 0, 0});
  for (size_t w = 0; w < blk.warps.size(); ++w) {
    const int first = int(w) * kWarp, last = std::min(threads, first + kWarp) - 1;
    blk.warps[w].lowest = rev ? threads - 1 - last : first;
  }
  blk.slots.assign(size_t(blk.warps.size() * kWarp), Slot{});
  blk.words.assign(2 * blk.slots.size(), 0);
  g_block = &blk;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = blk.fibers[size_t(t)];
    if (!f.stack) {
      f.stack = std::make_unique_for_overwrite<char[]>(kStack);
      f.ctx.bottom = f.stack.get(), f.ctx.size = kStack;
#ifdef LOOM_CUDA_EMU_TSAN
      f.ctx.tsan = __tsan_create_fiber(0);
      f.name = "CUDA thread " + std::to_string(t);
      __tsan_set_fiber_name(f.ctx.tsan, f.name.c_str());
#endif
    }
    f.done = false;
    f.waits = nullptr;
    f.groups.clear();
    f.open.clear();
    f.ctx.sp = fresh_stack(f.stack.get(), kStack);
  }
#ifdef LOOM_CUDA_EMU_TSAN
  blk.sched.tsan = __tsan_get_current_fiber();
#endif
  release(&blk.start);
  blk.scan_from = 0;
  for (;;) {
    // Positions from scan_from on, in scheduling order (fiber t = position, or its mirror).
    int next = -1;
    bool left = false;
    for (int i = blk.scan_from; i < threads; ++i) {
      const int t = rev ? threads - 1 - i : i;
      const Fiber& f = blk.fibers[size_t(t)];
      if (f.done) continue;
      left = true;
      if (!f.waits || f.waits->gen != f.wait_gen) {
        next = t, blk.scan_from = i;
        break;
      }
    }
    if (next < 0 && blk.scan_from > 0) {  // look below once more
      blk.scan_from = 0;
      continue;
    }
    if (next < 0 && !left) break;
    if (next < 0) {
      // Every fiber left waits on a barrier that some fiber passed by or finished without: the
      // kernel's barriers do not match.
      std::fprintf(stderr, "cuda emulation: barrier deadlock (a barrier not reached by all)\n");
      std::abort();
    }
    g_tid = next;
    switch_context(blk.sched, blk.fibers[size_t(next)].ctx);
  }
  acquire(&blk.end);
  g_block = nullptr;
}

// The kernels' static __shared__ variables, in a section of their own (tests/cuda_emu/device.hpp):
// the linker's bounds of it, null where no kernel has one.
extern "C" char __start_loom_cuda_shared[] __attribute__((weak));
extern "C" char __stop_loom_cuda_shared[] __attribute__((weak));

// Runs a grid of blocks, one after another (x fastest): body(tid) with the block's indices in
// the Block; smem_bytes of dynamic shared memory per block. Before each block, its shared memory
// (the dynamic bytes and every kernel's static __shared__ variables) is filled with garbage
// (large values, never zeros), as a block finds it on a GPU: what another block left.
inline void run_grid(Dim grid, Dim block, size_t smem_bytes, const std::function<void(int)>& body) {
  static Block blk;
  struct alignas(16) Chunk {
    char bytes[16];
  };
  // Sized to the 16 bytes above smem_bytes only: ASan reports a read past the block's bytes.
  std::vector<Chunk> smem((smem_bytes + 15) / 16);
  char* base = reinterpret_cast<char*>(smem.data());
  char* statics = __start_loom_cuda_shared;
  const size_t static_bytes = statics ? size_t(__stop_loom_cuda_shared - statics) : 0;
  const int threads = int(block.x * block.y * block.z);
  blk.grid_dim = grid, blk.block_dim = block, blk.dynamic_smem = base;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        {
          const Untracked u;
          if (smem_bytes) std::memset(base, 0x7f, smem_bytes);
          if (static_bytes) std::memset(statics, 0x7f, static_bytes);
        }
        blk.block_idx = Dim{bx, by, bz};
        run_block(blk, threads, body);
      }
}

}  // namespace loom::cuda_emu
