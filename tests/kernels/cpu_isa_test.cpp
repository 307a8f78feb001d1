#include "kernels/cpu/cpu_isa.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/swiglu.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using cpu::Isa;
using cpu::parse_cpu_isa;

namespace {

const std::vector<Isa> kAll = {Isa::baseline, Isa::avx2, Isa::avx512};
const std::vector<Isa> kZen3 = {Isa::baseline, Isa::avx2};  // an AVX2 CPU without AVX-512
const std::vector<Isa> kOld = {Isa::baseline};              // an x86-64 CPU without AVX2

}  // namespace

TEST(CpuIsa, NativeOrUnsetPicksTheBestAvailableTier) {
  EXPECT_EQ(parse_cpu_isa("native", kAll), Isa::avx512);
  EXPECT_EQ(parse_cpu_isa("native", kZen3), Isa::avx2);
  EXPECT_EQ(parse_cpu_isa("native", kOld), Isa::baseline);
  EXPECT_EQ(parse_cpu_isa("", kAll), Isa::avx512);
  EXPECT_EQ(parse_cpu_isa("", kOld), Isa::baseline);
  EXPECT_EQ(parse_cpu_isa("NATIVE", kZen3), Isa::avx2);
}

TEST(CpuIsa, NamedTierIsTaken) {
  EXPECT_EQ(parse_cpu_isa("baseline", kAll), Isa::baseline);
  EXPECT_EQ(parse_cpu_isa("avx2", kAll), Isa::avx2);
  EXPECT_EQ(parse_cpu_isa("avx512", kAll), Isa::avx512);
  EXPECT_EQ(parse_cpu_isa("avx2", kZen3), Isa::avx2);
  EXPECT_EQ(parse_cpu_isa("baseline", kOld), Isa::baseline);
  EXPECT_EQ(parse_cpu_isa("AVX2", kAll), Isa::avx2);  // as ONEDNN_MAX_CPU_ISA spells it
}

TEST(CpuIsa, UnknownNameIsAnErrorListingTheTiers) {
  test::expect_error([] { parse_cpu_isa("avx3", kZen3); },
                     {"LOOM_CPU_ISA='avx3'", "not a tier", "baseline, avx2, avx512, native",
                      "this CPU has baseline, avx2, native"});
  test::expect_error([] { parse_cpu_isa("sse4", kOld); },
                     {"'sse4'", "not a tier", "this CPU has baseline, native"});
  test::expect_error([] { parse_cpu_isa(" avx2", kAll); }, {"' avx2'", "not a tier"});
}

TEST(CpuIsa, UnavailableTierIsAnErrorListingTheTiers) {
  test::expect_error(
      [] { parse_cpu_isa("avx512", kZen3); },
      {"LOOM_CPU_ISA='avx512'", "lacks the avx512 tier", "it has baseline, avx2, native"});
  test::expect_error([] { parse_cpu_isa("avx2", kOld); },
                     {"'avx2'", "lacks the avx2 tier", "it has baseline, native"});
  test::expect_error([] { parse_cpu_isa("AVX512", kOld); }, {"'AVX512'", "lacks the avx512 tier"});
}

// The process's own configuration is the parser applied to its environment.
TEST(CpuIsa, ProcessTierIsTheParsedEnvironment) {
  const cpu::CpuIsa& c = cpu::cpu_isa();
  ASSERT_FALSE(c.available.empty());
  for (size_t i = 1; i < c.available.size(); ++i)
    EXPECT_LT(int(c.available[i - 1]), int(c.available[i]));
  const char* env = std::getenv("LOOM_CPU_ISA");
  EXPECT_EQ(c.kernels, parse_cpu_isa(env ? env : "", c.available));
  EXPECT_EQ(c.requested, env && *env ? env : "native");
  // The build is portable (no -march), so the baseline tier exists on every x86-64 CPU.
  EXPECT_EQ(c.available.front(), Isa::baseline);
}

// Highway's dispatch really switches: the probe (compiled per tier like the kernels) reports the
// tier of ScopedKernelIsa inside it and the process's tier outside.
TEST(CpuIsa, ScopedKernelIsaSwitchesTheDispatchedCode) {
  const Isa process = cpu::cpu_isa().kernels;
  EXPECT_EQ(cpu::active_kernel_isa(), process);
  for (Isa isa : test::kernel_isas()) {
    {
      cpu::ScopedKernelIsa scope(isa);
      EXPECT_EQ(cpu::active_kernel_isa(), isa) << cpu::isa_name(isa);
    }
    EXPECT_EQ(cpu::active_kernel_isa(), process) << "after " << cpu::isa_name(isa);
  }
  // A tier above the process's cap (or the CPU) cannot be forced.
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (int(isa) <= int(process)) continue;
    test::expect_error([&] { cpu::ScopedKernelIsa scope(isa); },
                       {"ScopedKernelIsa", cpu::isa_name(isa)});
    EXPECT_EQ(cpu::active_kernel_isa(), process);
  }
}

// A binary copied to an older CPU runs the best tier that CPU has: simulated by the tiers such a
// CPU reports (the parser picks), then forcing that tier and running a kernel on it.
TEST(CpuIsa, OlderCpuRunsItsBestAvailableTier) {
  for (const auto& cpu_tiers : {kOld, kZen3, kAll}) {
    const Isa best = parse_cpu_isa("native", cpu_tiers);
    EXPECT_EQ(best, cpu_tiers.back());
    if (int(best) > int(cpu::cpu_isa().kernels)) continue;  // this CPU or LOOM_CPU_ISA lacks it
    cpu::ScopedKernelIsa scope(best);
    ASSERT_EQ(cpu::active_kernel_isa(), best);
    const int64_t rows = 3, F = 37;
    auto gu = test::randn(size_t(rows * 2 * F), 5);
    std::vector<float> h(size_t(rows * F));
    cpu::swiglu_forward(gu.data(), rows, F, h.data());
    std::vector<double> ref(h.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < F; ++j) {
        const double g = gu[r * 2 * F + j], u = gu[r * 2 * F + F + j];
        ref[r * F + j] = g / (1 + std::exp(-g)) * u;
      }
    EXPECT_LT(test::rel_l2(h, ref), 1e-6) << cpu::isa_name(best);
  }
}
