// `loom info` through the binary (LOOM_BIN): the JSON names every field with a value, agrees with
// the text output and with LOOM_CPU_ISA, and a bad argument is an error naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/apps/loom_command_test.hpp"

namespace {

using Result = loom::test::CommandResult;

class InfoCommand : public loom::test::LoomCommandTest {
 protected:
  Result run(const std::string& env, const std::string& args) {
    return LoomCommandTest::run(env, "info " + args);
  }
};

TEST_F(InfoCommand, JsonHasEveryFieldAndMatchesText) {
  Result r = run("", "--json --peak-seconds 0.02");
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const char* k :
       {"version", "commit", "cpu_model", "cpu_flags", "kernels", "requested", "available",
        "onednn_version", "onednn_isa", "bf16_gemm", "mpi", "load_average"}) {
    ASSERT_TRUE(j.contains(k) && j[k].is_string()) << k << " in " << r.out;
    EXPECT_FALSE(j[k].get<std::string>().empty()) << k;
  }
  EXPECT_GE(j["threads"].get<int>(), 1);
  EXPECT_GT(j["gemm_peak_f32_flops"].get<double>(), 1e9);
  EXPECT_GT(j["gemm_peak_bf16_flops"].get<double>(), 1e8);
  const std::string path = j["bf16_gemm"];
  EXPECT_TRUE(path.rfind("native (", 0) == 0 || path.rfind("widened to f32 (", 0) == 0) << path;

  Result t = run("", "--peak-seconds 0");
  ASSERT_EQ(t.rc, 0) << t.err;
  for (const char* k : {"cpu_model", "kernels", "onednn_isa", "bf16_gemm", "mpi"})
    EXPECT_NE(t.out.find(j[k].get<std::string>()), std::string::npos) << k << "\n" << t.out;
  EXPECT_NE(t.out.find("GEMM peak     not measured"), std::string::npos) << t.out;
}

// The GPU lines: a loom with the CUDA backend names its runtime and either lists its GPUs or says
// why none can be used (no driver, an old driver); one without the backend says it was built
// without it. Both in the text and the JSON.
TEST_F(InfoCommand, GpuLinesSayWhatThereIs) {
  Result r = run("", "--json --peak-seconds 0");
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json g = nlohmann::json::parse(r.out)["gpu"];
  Result t = run("", "--peak-seconds 0");
  ASSERT_EQ(t.rc, 0) << t.err;
  if (!g["cuda_backend"].get<bool>()) {
    EXPECT_NE(g["none"].get<std::string>().find("built without the CUDA backend"),
              std::string::npos);
    EXPECT_NE(t.out.find("gpu           none: this loom was built without the CUDA backend"),
              std::string::npos)
        << t.out;
    return;
  }
  EXPECT_NE(g["backend"].get<std::string>().find("CUDA runtime 13."), std::string::npos) << g;
  EXPECT_NE(t.out.find("  gpu backend   CUDA runtime"), std::string::npos) << t.out;
  if (g["gpus"].empty()) {
    ASSERT_FALSE(g["none"].get<std::string>().empty()) << g;
    EXPECT_NE(t.out.find("gpu           none: " + g["none"].get<std::string>()), std::string::npos)
        << t.out;
  } else {
    EXPECT_NE(t.out.find("gpu           0: "), std::string::npos) << t.out;
  }
}

// AVX2 is the tier every x86-64 CPU loom targets has (below it only the baseline): capped there,
// the kernels and oneDNN say so, and bf16 GEMMs are widened (oneDNN 2.6 has no AVX2 bf16 matmul).
TEST_F(InfoCommand, FollowsLoomCpuIsa) {
  Result r = run("LOOM_CPU_ISA=avx2", "--json --peak-seconds 0");
  if (r.rc != 0 && r.err.find("lacks it") != std::string::npos) GTEST_SKIP() << "no AVX2 here";
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kernels"], "avx2");
  EXPECT_EQ(j["requested"], "avx2");
  EXPECT_EQ(j["onednn_isa"], "avx2");
  EXPECT_EQ(j["bf16_gemm"].get<std::string>().rfind("widened to f32", 0), 0u) << j["bf16_gemm"];
}

TEST_F(InfoCommand, BadArgumentsAreErrors) {
  Result r = run("", "--peak-seconds abc");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--peak-seconds"), std::string::npos) << r.err;
  r = run("", "--frobnicate");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--frobnicate"), std::string::npos) << r.err;
  r = run("LOOM_CPU_ISA=sse9", "");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("LOOM_CPU_ISA='sse9'"), std::string::npos) << r.err;
}

}  // namespace

// --tiers (scripts/test.sh uses it): the tiers of the JSON's "available", one per line, in order.
TEST_F(InfoCommand, TiersListsTheAvailableTiers) {
  Result r = run("", "--tiers");
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(run("", "--json --peak-seconds 0").out);
  std::string joined = r.out;
  if (!joined.empty() && joined.back() == '\n') joined.pop_back();
  std::replace(joined.begin(), joined.end(), '\n', ' ');
  EXPECT_EQ(joined, j["available"].get<std::string>());
  EXPECT_EQ(r.out.rfind("baseline\n", 0), 0u) << r.out;
}
