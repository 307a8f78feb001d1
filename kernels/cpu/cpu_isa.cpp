#include "kernels/cpu/cpu_isa.hpp"

#include <hwy/targets.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <oneapi/dnnl/dnnl.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"

// A probe compiled once per tier, like the kernel files (same HWY_DISABLED_TARGETS), so that
// active_kernel_isa() asks the dispatch itself which tier's code runs.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cpu_isa.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace loom::cpu::HWY_NAMESPACE {

int64_t compiled_target_probe() {
  return HWY_TARGET;
}

}  // namespace loom::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::cpu {
namespace {

HWY_EXPORT(compiled_target_probe);

// Highway targets of each tier, and everything above it (disabled to cap at the tier). The
// kernels are compiled for HWY_AVX3, HWY_AVX2 and the static baseline only (CMakeLists.txt).
constexpr int64_t kAbove[] = {HWY_AVX2 | HWY_AVX3 | HWY_AVX3_DL, HWY_AVX3 | HWY_AVX3_DL,
                              HWY_AVX3_DL};
constexpr int64_t kTarget[] = {HWY_STATIC_TARGET, HWY_AVX2, HWY_AVX3};

// The Isa of a Highway target: the tier whose kernels it runs.
Isa isa_of_target(int64_t target) {
  if (target == HWY_AVX3) return Isa::avx512;
  if (target == HWY_AVX2) return Isa::avx2;
  return Isa::baseline;
}

// Tiers the CPU runs and this build has: the baseline tier is the static target, compiled only
// when it is below AVX2 (a build with -march at AVX2 or above would have no baseline kernels).
std::vector<Isa> detect() {
  const int64_t have = hwy::SupportedTargets() & HWY_TARGETS;
  std::vector<Isa> tiers;
  if (HWY_STATIC_TARGET > HWY_AVX2) tiers.push_back(Isa::baseline);  // larger bit: lower target
  if (have & HWY_AVX2) tiers.push_back(Isa::avx2);
  if (have & HWY_AVX3) tiers.push_back(Isa::avx512);
  if (tiers.empty()) tiers.push_back(isa_of_target(HWY_STATIC_TARGET));
  return tiers;
}

dnnl::cpu_isa onednn_cap(Isa isa) {
  switch (isa) {
    case Isa::baseline:
      return dnnl::cpu_isa::sse41;
    case Isa::avx2:
      return dnnl::cpu_isa::avx2;
    case Isa::avx512:
      return dnnl::cpu_isa::avx512_core_bf16;
  }
  return dnnl::cpu_isa::all;
}

const char* onednn_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

std::string tier_list(const std::vector<Isa>& tiers) {
  std::string s;
  for (Isa t : tiers) {
    s += isa_name(t);
    s += ", ";
  }
  s += "native";
  return s;
}

CpuIsa configure() {
  CpuIsa c;
  c.available = detect();
  const char* env = std::getenv("LOOM_CPU_ISA");
  c.requested = env && *env ? env : "native";
  try {
    c.kernels = parse_cpu_isa(c.requested, c.available);
  } catch (const Error& e) {
    fail(e.what(), " [CPU: ", cpu_model_name(), "]");
  }
  if (c.requested != "native") {
    hwy::DisableTargets(kAbove[int(c.kernels)]);
    // oneDNN takes the cap only before it has dispatched anything; cpu_isa() runs before the
    // first GEMM is built, and a refusal here would mean that promise was broken.
    LOOM_CHECK(dnnl::set_max_cpu_isa(onednn_cap(c.kernels)) == dnnl::status::success,
               "LOOM_CPU_ISA='", c.requested, "': oneDNN refused the ISA cap (called too late)");
  }
  const dnnl::cpu_isa eff = dnnl::get_effective_cpu_isa();
  c.onednn = onednn_name(eff);
  c.onednn_native_bf16 =
      eff == dnnl::cpu_isa::avx512_core_bf16 || eff == dnnl::cpu_isa::avx512_core_amx;
  return c;
}

// /proc/cpuinfo's first value of `key`, or "".
std::string cpuinfo(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    return line.substr(line.find_first_not_of(' ', colon + 1) == std::string::npos
                           ? line.size()
                           : line.find_first_not_of(' ', colon + 1));
  }
  return "";
}

}  // namespace

Isa parse_cpu_isa(std::string_view value, const std::vector<Isa>& available) {
  LOOM_CHECK(!available.empty(), "parse_cpu_isa: no available tiers");
  std::string v(value);
  for (char& ch : v) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  if (v.empty() || v == "native") return available.back();
  for (Isa t : {Isa::baseline, Isa::avx2, Isa::avx512}) {
    if (v != isa_name(t)) continue;
    for (Isa a : available)
      if (a == t) return t;
    fail("LOOM_CPU_ISA='", value, "': this CPU lacks the ", isa_name(t), " tier; it has ",
         tier_list(available));
  }
  fail("LOOM_CPU_ISA='", value,
       "' is not a tier; expected one of baseline, avx2, avx512, native (this CPU has ",
       tier_list(available), ")");
}

Isa active_kernel_isa() {
  cpu_isa();
  return isa_of_target(HWY_DYNAMIC_DISPATCH(compiled_target_probe)());
}

namespace {
std::atomic<bool> g_bf16_native_allowed{true};
}  // namespace

bool avx512_bf16_native() {
  static const bool cpu_has = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
#else
    return false;
#endif
  }();
  return cpu_has && g_bf16_native_allowed.load(std::memory_order_relaxed) &&
         active_kernel_isa() == Isa::avx512;
}

void set_avx512_bf16_native_allowed(bool allowed) {
  g_bf16_native_allowed.store(allowed);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::baseline:
      return "baseline";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

const CpuIsa& cpu_isa() {
  static const CpuIsa c = configure();
  return c;
}

std::string cpu_model_name() {
  const std::string m = cpuinfo("model name");
  return m.empty() ? "unknown x86-64 CPU" : m;
}

std::string cpu_flags_summary() {
  static const char* kWanted[] = {"sse4_2",   "avx",         "avx2",        "fma",
                                  "f16c",     "avx512f",     "avx512bw",    "avx512vl",
                                  "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                                  "amx_tile", "amx_bf16",    "amx_int8"};
  std::set<std::string> have;
  std::istringstream flags(cpuinfo("flags"));
  for (std::string f; flags >> f;) have.insert(f);
  std::string out;
  for (const char* w : kWanted) {
    if (!have.count(w)) continue;
    if (!out.empty()) out += ' ';
    out += w;
  }
  return out;
}

ScopedKernelIsa::ScopedKernelIsa(Isa isa) {
  const CpuIsa& c = cpu_isa();
  bool have = false;
  for (Isa a : c.available) have = have || (a == isa && int(a) <= int(c.kernels));
  LOOM_CHECK(have, "ScopedKernelIsa: tier ", isa_name(isa), " is not available (this process runs ",
             tier_list(c.available), " capped at ", isa_name(c.kernels), ")");
  // The mock replaces the detected targets (DisableTargets from LOOM_CPU_ISA still applies);
  // Highway resets its dispatch tables, so the next call of each kernel picks `isa`'s code.
  hwy::SetSupportedTargetsForTest(kTarget[int(isa)] | HWY_STATIC_TARGET);
}

ScopedKernelIsa::~ScopedKernelIsa() {
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace loom::cpu
#endif  // HWY_ONCE
