#pragma once
// Which instruction-set tier loom's CPU kernels and oneDNN run, chosen once per process.
//
// One binary serves every x86-64 CPU: each kernel file is compiled once per tier (Highway's
// foreach_target, kernels/cpu/*.cpp) and dispatched at run time to the best tier the CPU has, or
// to the tier named by LOOM_CPU_ISA, which caps oneDNN's ISA (dnnl::set_max_cpu_isa) too:
//   baseline   SSE2 kernels (any x86-64), oneDNN up to SSE4.1
//   avx2       AVX2 + FMA kernels, oneDNN up to AVX2
//   avx512     AVX-512 (F, VL, DQ, BW) kernels, oneDNN up to AVX512_CORE_BF16 (no AMX)
//   native     the best of everything the CPU has (the default)
#include <string>
#include <string_view>
#include <vector>

namespace loom::cpu {

// Tiers of loom's own kernels, lowest first.
enum class Isa { baseline, avx2, avx512 };

const char* isa_name(Isa isa);

struct CpuIsa {
  std::string requested;       // LOOM_CPU_ISA, or "native" when unset
  Isa kernels;                 // the tier loom's kernels run
  std::string onednn;          // oneDNN's effective ISA, e.g. "avx512_core_bf16"
  bool onednn_native_bf16;     // oneDNN has bf16 matmul instructions here (AVX512_BF16 or AMX)
  std::vector<Isa> available;  // tiers this CPU can run, lowest first
};

// Configures the process on first call (reads LOOM_CPU_ISA, disables the kernel tiers above it,
// caps oneDNN) and returns the result. Must run before the first oneDNN primitive is created;
// every kernel dispatch and the GEMM call it, so that holds without the caller's help. Throws
// loom::Error naming the tiers this CPU has when LOOM_CPU_ISA is unknown or unavailable.
const CpuIsa& cpu_isa();

// The tier LOOM_CPU_ISA=`value` selects on a CPU with the tiers `available` (lowest first, never
// empty): "native" or "" is the best of `available`; a tier name (case-insensitive) must be one of
// `available`. Otherwise throws loom::Error naming the value and listing `available`. Pure, so
// tests can pretend to be an older CPU by passing a shorter list; cpu_isa() uses it.
Isa parse_cpu_isa(std::string_view value, const std::vector<Isa>& available);

// The tier whose code loom's kernels dispatch to right now: LOOM_CPU_ISA's cap, or the tier of an
// enclosing ScopedKernelIsa. Asks Highway's dispatch itself (a probe compiled per tier, as the
// kernels are), so it reports the code path that actually runs.
Isa active_kernel_isa();

// Whether loom's kernels run AVX512_BF16 instructions now (vdpbf16ps, the vcvtne*2bf16 roundings):
// the avx512 tier is in use, the CPU has AVX512_BF16 (Skylake-X and Ice Lake have AVX-512
// without it) and the tests have not turned them off. Kernels ask per call and pass it down.
bool avx512_bf16_native();
// Tests: false makes the avx512 tier run what the lower tiers run instead (default true).
void set_avx512_bf16_native_allowed(bool allowed);

// The CPU's model name and the instruction-set flags that matter to loom ("avx2 fma avx512f ...").
std::string cpu_model_name();
std::string cpu_flags_summary();

// Runs loom's kernels at `isa` until destroyed (tests compare every tier with the reference).
// `isa` must be one of cpu_isa().available and at most cpu_isa().kernels (loom::Error otherwise).
// Not thread-safe: the dispatch table is process-wide.
class ScopedKernelIsa {
 public:
  explicit ScopedKernelIsa(Isa isa);
  ~ScopedKernelIsa();
  ScopedKernelIsa(const ScopedKernelIsa&) = delete;
  ScopedKernelIsa& operator=(const ScopedKernelIsa&) = delete;
};

}  // namespace loom::cpu

// The kernel of the tier in use: LOOM_DISPATCH(fn)(args...) in a kernel file's HWY_ONCE part,
// where HWY_EXPORT(fn) made the table. cpu_isa() first, so that LOOM_CPU_ISA has been applied.
#define LOOM_DISPATCH(fn) (::loom::cpu::cpu_isa(), HWY_DYNAMIC_DISPATCH(fn))
