// `loom bench attention` through the binary (LOOM_BIN), on the CPU with small shapes: its JSON rows
// and text table, and bad arguments refused by name. (On a GPU, scripts/device_check.sh runs it at
// the published shapes, and bench/compare_attention_gpu.py puts PyTorch's SDPA beside it.)
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/apps/loom_command_test.hpp"

namespace {

using Result = loom::test::CommandResult;

class BenchAttention : public loom::test::LoomCommandTest {
 protected:
  Result run(const std::string& args) {
    return LoomCommandTest::run("OMP_NUM_THREADS=1", "bench attention " + args);
  }
};

TEST_F(BenchAttention, JsonRowsPerShapeOnTheCpu) {
  for (const char* dtype : {"bf16", "f32"}) {
    const Result r = run(std::string("--device cpu --dims 64,32 --seq 96,128 --tokens 256 ") +
                         "--heads 4/2 --iters 1 --json --dtype " + dtype);
    ASSERT_EQ(r.rc, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["device"], "the CPU");
    ASSERT_EQ(j["rows"].size(), 4u) << r.out;
    const int64_t want[4][3] = {{64, 96, 2}, {64, 128, 2}, {32, 96, 2}, {32, 128, 2}};
    for (size_t i = 0; i < 4; ++i) {
      const nlohmann::json& row = j["rows"][i];
      EXPECT_EQ(row["D"], want[i][0]);
      EXPECT_EQ(row["T"], want[i][1]);
      EXPECT_EQ(row["B"], want[i][2]);
      EXPECT_EQ(row["Hq"], 4);
      EXPECT_EQ(row["Hkv"], 2);
      EXPECT_EQ(row["dtype"], dtype[0] == 'b' ? "bfloat16" : "float32");
      for (const char* k : {"forward_ms", "backward_ms", "forward_tflops", "backward_tflops"}) {
        const double v = row[k].get<double>();
        EXPECT_TRUE(std::isfinite(v) && v > 0) << k << " = " << v;
      }
      // TFLOP/s is the causal FLOP count over the time: 2 (forward) and 5 (backward) products of
      // 2 D FLOPs per (query, key) pair of the causal half.
      const double T = double(want[i][1]), pairs = 2 * 4 * T * (T + 1) / 2;
      const double product = 2 * pairs * double(want[i][0]);
      EXPECT_NEAR(row["forward_tflops"].get<double>(),
                  2 * product / (row["forward_ms"].get<double>() * 1e-3) * 1e-12,
                  1e-9 * row["forward_tflops"].get<double>());
      EXPECT_NEAR(row["backward_tflops"].get<double>(),
                  5 * product / (row["backward_ms"].get<double>() * 1e-3) * 1e-12,
                  1e-9 * row["backward_tflops"].get<double>());
    }
  }
  const Result t = run("--device cpu --dims 64 --seq 64 --tokens 64 --heads 2/1 --iters 1");
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("attention on the CPU, bfloat16, causal, 2/1 heads, 64 tokens a call"),
            std::string::npos)
      << t.out;
}

TEST_F(BenchAttention, BadArgumentsAreRefusedByName) {
  const struct {
    const char* args;
    const char* says;
  } bad[] = {{"--heads 5/2", "--heads 5/2: the query heads must be a multiple"},
             {"--heads 8", "--heads: expected HQ/HKV, got '8'"},
             {"--dims 64,x", "--dims: expected positive integers separated by commas, got '64,x'"},
             {"--seq 0", "--seq: expected positive integers"},
             {"--dtype f16", "--dtype: expected bf16 or f32, got 'f16'"},
             {"--device tpu", "--device: expected auto, cpu or cuda, got 'tpu'"},
             {"--frobnicate", "bench attention: unknown argument '--frobnicate'"}};
  for (const auto& b : bad) {
    const Result r = run(b.args);
    EXPECT_NE(r.rc, 0) << b.args;
    EXPECT_NE(r.err.find(b.says), std::string::npos) << b.args << ": " << r.err;
  }
}

}  // namespace
