#include "kernels/cpu/cpu_isa.hpp"

#include <hwy/targets.h>

#include <cstdlib>
#include <fstream>
#include <oneapi/dnnl/dnnl.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace loom::cpu {
namespace {

// Highway targets of each tier, and everything above it (disabled to cap at the tier). The
// kernels are compiled for HWY_AVX3, HWY_AVX2 and the static baseline only (CMakeLists.txt).
constexpr int64_t kAbove[] = {HWY_AVX2 | HWY_AVX3 | HWY_AVX3_DL, HWY_AVX3 | HWY_AVX3_DL,
                              HWY_AVX3_DL};
constexpr int64_t kTarget[] = {HWY_STATIC_TARGET, HWY_AVX2, HWY_AVX3};

std::vector<Isa> detect() {
  const int64_t have = hwy::SupportedTargets();
  std::vector<Isa> tiers{Isa::baseline};
  if (have & HWY_AVX2) tiers.push_back(Isa::avx2);
  if (have & HWY_AVX3) tiers.push_back(Isa::avx512);
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
  c.kernels = c.available.back();
  if (c.requested != "native") {
    bool known = false, have = false;
    for (Isa t : {Isa::baseline, Isa::avx2, Isa::avx512}) {
      if (c.requested != isa_name(t)) continue;
      known = true;
      for (Isa a : c.available) have = have || a == t;
      c.kernels = t;
    }
    LOOM_CHECK(known, "LOOM_CPU_ISA='", c.requested,
               "' is not a tier; expected one of baseline, avx2, avx512, native (this CPU has ",
               tier_list(c.available), ")");
    LOOM_CHECK(have, "LOOM_CPU_ISA='", c.requested, "': this CPU (", cpu_model_name(),
               ") lacks it; it has ", tier_list(c.available));
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
  cpu_isa();
  hwy::SetSupportedTargetsForTest(kTarget[int(isa)] | HWY_STATIC_TARGET);
}

ScopedKernelIsa::~ScopedKernelIsa() {
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace loom::cpu
