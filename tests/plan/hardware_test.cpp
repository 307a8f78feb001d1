// plan/hardware: the shipped hardware files load, bad files are errors naming the key and file,
// the collective and kernel times follow their formulas, and a quick calibration writes a file
// that loads back with positive figures (the machine's speed itself is not asserted).
#include "plan/hardware.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/error.hpp"
#include "plan/calibrate.hpp"

using namespace loom;
using namespace loom::plan;

namespace {

std::string source_dir() {
  const char* s = std::getenv("LOOM_SOURCE_DIR");
  return s && *s ? s : ".";
}

const char* kMinimal = R"(
name = "toy"
ranks_per_node = 4
capacity = 1e9
memory_bandwidth = 1e11
[peak]
f32 = 1e12
bf16 = 2e12
[gemm]
efficiency = 0.5
[links.intra_node]
bandwidth = 1e10
latency = 1e-6
[links.inter_node]
bandwidth = 1e9
latency = 1e-5
)";

// The error message of parsing `text`, or "" when it parses.
std::string parse_error(const std::string& text) {
  try {
    parse_hardware(text, "toy.toml");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Hardware, ShippedFilesLoad) {
  for (const char* name : {"h100-sxm-80g", "h100-96g-500w", "h200", "cpu-local"}) {
    const Hardware hw = load_hardware(source_dir() + "/configs/hardware/" + name + ".toml");
    EXPECT_EQ(hw.name, name);
    EXPECT_GT(hw.peak_bf16, 0);
    EXPECT_GT(hw.peak_f32, 0);
    EXPECT_GT(hw.memory_bandwidth, 0);
    EXPECT_GT(hw.capacity, 0);
    EXPECT_GT(hw.intra_node.bandwidth, 0);
    EXPECT_GT(hw.inter_node.latency, 0);
  }
  const Hardware h100 = load_hardware(source_dir() + "/configs/hardware/h100-sxm-80g.toml");
  EXPECT_EQ(h100.peak_bf16, 989e12);
  EXPECT_EQ(h100.ranks_per_node, 8);
}

TEST(Hardware, BareNameResolvesUnderConfigs) {
  // From the source tree (the tests run with LOOM_SOURCE_DIR set, the binary from the repo root).
  EXPECT_EQ(load_hardware("h200").capacity, 141e9);
  try {
    load_hardware("no-such-machine");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-machine.toml"), std::string::npos) << e.what();
  }
  try {
    load_hardware("/nonexistent/dir/x.toml");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/x.toml"), std::string::npos);
  }
}

TEST(Hardware, BadFilesNameTheKeyAndFile) {
  EXPECT_EQ(parse_error(kMinimal), "");
  std::string e = parse_error(std::string(kMinimal) + "[attention]\nefficency = 0.5\n");
  EXPECT_NE(e.find("toy.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("attention.efficency"), std::string::npos) << e;
  e = parse_error("bogus = 1\n" + std::string(kMinimal));
  EXPECT_NE(e.find("'bogus'"), std::string::npos) << e;
  e = parse_error(std::string(kMinimal) + "[memory_ops]\nrmsnorm = 1e9\n");
  EXPECT_NE(e.find("memory_ops.rmsnorm"), std::string::npos) << e;
  std::string no_bf16 = kMinimal;
  no_bf16.erase(no_bf16.find("bf16 = 2e12"), 11);
  e = parse_error(no_bf16);
  EXPECT_NE(e.find("missing key 'peak.bf16'"), std::string::npos) << e;
  EXPECT_NE(e.find("toy.toml"), std::string::npos) << e;
  std::string negative = kMinimal;
  negative.replace(negative.find("efficiency = 0.5"), 16, "efficiency = -1");
  e = parse_error(negative);
  EXPECT_NE(e.find("gemm.efficiency"), std::string::npos) << e;
  e = parse_error(std::string(kMinimal) + "[gemm.x]\n");
  EXPECT_NE(e.find("toy.toml"), std::string::npos) << e;
  e = parse_error("name = \"x\"\n[peak\n");
  EXPECT_NE(e.find("toy.toml:2"), std::string::npos) << e;
  std::string on_core = kMinimal;
  on_core.replace(on_core.find("[links.intra_node]"), 18,
                  "[links]\ntransfers_on_core = 1\n[links.intra_node]");
  e = parse_error(on_core);
  EXPECT_NE(e.find("'links.transfers_on_core' must be true or false"), std::string::npos) << e;
  on_core.replace(on_core.find("= 1\n"), 3, "= true");
  EXPECT_EQ(parse_error(on_core), "");
  EXPECT_TRUE(parse_hardware(on_core, "toy.toml").transfers_on_core);
  EXPECT_FALSE(parse_hardware(kMinimal, "toy.toml").transfers_on_core);
  // sync_wait: a fraction, at least 0 (more than 1 on a busy machine); absent is 0.
  EXPECT_EQ(parse_hardware(kMinimal, "toy.toml").sync_wait, 0);
  for (const char* bad : {"sync_wait = -0.1", "sync_wait = \"x\"", "sync_wait = nan"}) {
    std::string wait = kMinimal;
    wait.replace(wait.find("[links.intra_node]"), 18,
                 std::string("[links]\n") + bad + "\n[links.intra_node]");
    e = parse_error(wait);
    EXPECT_NE(e.find("links.sync_wait"), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("toy.toml"), std::string::npos) << bad << ": " << e;
  }
  std::string wait = kMinimal;
  wait.replace(wait.find("[links.intra_node]"), 18,
               "[links]\nsync_wait = 0.02\n[links.intra_node]");
  EXPECT_DOUBLE_EQ(parse_hardware(wait, "toy.toml").sync_wait, 0.02);
}

TEST(Hardware, CollectivesFollowTheRingFormulas) {
  const Hardware hw = parse_hardware(kMinimal, "toy.toml");
  const double a = 1e-6, b = 1e10, A = 1e-5, B = 1e9;
  // 8 ranks all-gathering 1 MB each: (n-1) * 1 MB sent per rank.
  const uint64_t sent = 7 * 1000000;
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_gather, sent, 8, false, hw),
                   7e6 / b + 7 * a);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::reduce_scatter, sent, 8, true, hw),
                   7e6 / B + 7 * A);
  // all_reduce of 1 MB: 2 (n-1)/n MB sent, 2 (n-1) steps.
  const uint64_t ar = 2 * 7 * 1000000 / 8;
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_reduce, ar, 8, false, hw),
                   1.75e6 / b + 14 * a);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::send, 4096, 2, false, hw), a + 4096 / b);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::recv, 4096, 2, true, hw), A + 4096 / B);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::barrier, 0, 8, false, hw), 3 * a);
  // Across nodes with 4 of the group's ranks on each: four rings, one per NIC (4 B < b), capped
  // by the intra-node link (16 B > b); a send still uses one NIC.
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_gather, sent, 8, 4, hw),
                   7e6 / (4 * B) + 7 * A);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_gather, sent, 32, 16, hw),
                   7e6 / b + 31 * A);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::send, 4096, 2, 4, hw), A + 4096 / B);
  EXPECT_EQ(collective_seconds(CollectiveKind::all_reduce, 0, 1, false, hw), 0);
  EXPECT_STREQ(collective_name(CollectiveKind::reduce_scatter), "reduce_scatter");
  // all_to_all_v (the sim group's op name) as all_to_all: its bytes over the link, n-1 steps.
  EXPECT_STREQ(collective_name(CollectiveKind::all_to_all_v), "all_to_all_v");
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all_v, sent, 8, false, hw),
                   collective_seconds(CollectiveKind::all_to_all, sent, 8, false, hw));
  // Across nodes an all-to-all is no ring: of 16 ranks, 8 on each node (expert parallelism over
  // two nodes), a rank's shares for the 8 on the other node leave through its own NIC (8/15 of
  // its bytes at B) while those for the 7 beside it cross the node's link (7/15 at b).
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all_v, 15000000, 16, 8, hw),
                   8e6 / B + 15 * A);
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all, 15000000, 16, 8, hw),
                   8e6 / B + 15 * A);
  // Alone on its node, every share goes through the NIC: as a ring over one NIC.
  EXPECT_DOUBLE_EQ(collective_seconds(CollectiveKind::all_to_all_v, sent, 8, 1, hw),
                   collective_seconds(CollectiveKind::all_gather, sent, 8, 1, hw));
}

TEST(Hardware, KernelSecondsIsARoofline) {
  Hardware hw = parse_hardware(kMinimal, "toy.toml");
  ops::KernelWork g;
  g.op = "linear";
  g.dtype = DType::bf16;
  g.m = g.n = g.k = 1024;
  g.flops = 2e9;
  g.bytes = 1e6;
  // Compute-bound: 2e9 / (2e12 * 0.5).
  EXPECT_DOUBLE_EQ(kernel_seconds(g, hw), 2e-3);
  g.bytes = 1e9;  // now memory-bound: 1e9 / 1e11
  EXPECT_DOUBLE_EQ(kernel_seconds(g, hw), 1e-2);
  // A measured table replaces peak * efficiency: the nearest shape's rate.
  hw.gemm_bf16 = {{64, 64, 64, 1e10}, {1024, 1024, 1024, 4e11}, {4096, 4096, 4096, 8e11}};
  g.bytes = 0;
  EXPECT_DOUBLE_EQ(kernel_seconds(g, hw), 2e9 / 4e11);
  EXPECT_DOUBLE_EQ(gemm_rate(hw, DType::bf16, 100, 50, 80), 1e10);
  EXPECT_DOUBLE_EQ(gemm_rate(hw, DType::bf16, 16384, 8192, 4096), 8e11);
  EXPECT_DOUBLE_EQ(gemm_rate(hw, DType::f32, 64, 64, 64), 0.5e12);  // no f32 table
  // A memory-bound op at its own bandwidth when the file gives one.
  ops::KernelWork r;
  r.op = "rmsnorm_forward";
  r.bytes = 1e9;
  r.flops = 1e6;
  EXPECT_DOUBLE_EQ(kernel_seconds(r, hw), 1e-2);
  hw.op_bandwidth["rmsnorm_forward"] = 5e10;
  EXPECT_DOUBLE_EQ(kernel_seconds(r, hw), 2e-2);
  // Attention at its efficiency of its dtype's peak, or of attention.dtype's.
  ops::KernelWork at;
  at.op = "attention_backward";
  at.flops = 1e12;
  hw.attention_efficiency = 0.5;
  hw.attention_backward_efficiency = 0.25;
  EXPECT_DOUBLE_EQ(kernel_seconds(at, hw), 1e12 / (1e12 * 0.25));
  hw.has_attention_dtype = true;
  hw.attention_dtype = DType::bf16;
  EXPECT_DOUBLE_EQ(kernel_seconds(at, hw), 1e12 / (2e12 * 0.25));
  // Ring attention's block kernels at their own efficiencies.
  hw.attention_block_efficiency = 0.4;
  hw.attention_block_backward_efficiency = 0.2;
  at.op = "attention_block_backward";
  EXPECT_DOUBLE_EQ(kernel_seconds(at, hw), 1e12 / (2e12 * 0.2));
  at.op = "attention_block_forward";
  EXPECT_DOUBLE_EQ(kernel_seconds(at, hw), 1e12 / (2e12 * 0.4));
  // A file without them prices the block kernels as the whole-sequence ones.
  const Hardware plain = parse_hardware(
      std::string(kMinimal) + "[attention]\nefficiency = 0.5\nbackward_efficiency = 0.3\n",
      "toy.toml");
  EXPECT_DOUBLE_EQ(plain.attention_block_efficiency, 0.5);
  EXPECT_DOUBLE_EQ(plain.attention_block_backward_efficiency, 0.3);
  // A calibrated byte term is paid on top of the FLOPs (not a roofline), for its kernel only.
  const Hardware with_bytes = parse_hardware(
      std::string(kMinimal) + "[attention]\nefficiency = 0.5\nblock_backward_bandwidth = 1e9\n",
      "toy.toml");
  at.bytes = 2e9;
  EXPECT_DOUBLE_EQ(kernel_seconds(at, with_bytes), 1e12 / (1e12 * 0.5));  // block forward: none
  at.op = "attention_block_backward";
  EXPECT_DOUBLE_EQ(kernel_seconds(at, with_bytes), 1e12 / (1e12 * 0.5) + 2e9 / 1e9);
  EXPECT_DOUBLE_EQ(with_bytes.attention_bandwidth[0], 0);
  EXPECT_NE(parse_error(std::string(kMinimal) + "[attention]\nbandwidth = -1\n").find("bandwidth"),
            std::string::npos);
  // loom's bf16 kernels on bf16 tensors: their own fraction of peak.bf16 and byte term where the
  // file measures them; otherwise the f32 kernels' fraction, of peak.bf16. Not the ring's block
  // kernels (f32), nor a device whose attention.dtype decides.
  const Hardware bf16 = parse_hardware(std::string(kMinimal) +
                                           "[attention]\nefficiency = 0.5\n"
                                           "backward_efficiency = 0.25\nbf16_efficiency = 0.3\n"
                                           "bf16_backward_efficiency = 0.2\n"
                                           "bf16_backward_bandwidth = 4e9\n",
                                       "toy.toml");
  ops::KernelWork hb;
  hb.op = "attention_backward";
  hb.dtype = DType::bf16;
  hb.flops = 1e12;
  hb.bytes = 2e9;
  EXPECT_DOUBLE_EQ(kernel_seconds(hb, bf16), 1e12 / (2e12 * 0.2) + 2e9 / 4e9);
  hb.op = "attention_forward";
  EXPECT_DOUBLE_EQ(kernel_seconds(hb, bf16), std::max(1e12 / (2e12 * 0.3), 2e9 / 1e11));
  EXPECT_DOUBLE_EQ(kernel_seconds(hb, plain), std::max(1e12 / (2e12 * 0.5), 2e9 / 1e11));
  hb.op = "attention_block_forward";
  EXPECT_DOUBLE_EQ(kernel_seconds(hb, bf16), std::max(1e12 / (2e12 * 0.5), 2e9 / 1e11));
  hb.dtype = DType::f32;
  hb.op = "attention_forward";
  EXPECT_DOUBLE_EQ(kernel_seconds(hb, bf16), std::max(1e12 / (1e12 * 0.5), 2e9 / 1e11));
  EXPECT_DOUBLE_EQ(optimizer_seconds(1e9, hw), 1e9 / 1e11);
  // CPU offload: without a [host] link the host pool is the rank's own memory (a CPU); with
  // one, the bytes that cross are priced on it, and the host steps AdamW at its own rate.
  ops::KernelWork h2d;
  h2d.op = "host_to_device";
  h2d.bytes = 6e6;
  h2d.link_bytes = 2e6;
  EXPECT_DOUBLE_EQ(kernel_seconds(h2d, hw), 6e6 / 1e11);
  EXPECT_DOUBLE_EQ(optimizer_seconds(1e9, hw, true), 1e9 / 1e11);
  const Hardware off = parse_hardware(
      std::string(kMinimal) + "[host]\nlink_bandwidth = 1e8\noptimizer_bandwidth = 1e10\n",
      "toy.toml");
  EXPECT_DOUBLE_EQ(kernel_seconds(h2d, off), 2e6 / 1e8);
  EXPECT_DOUBLE_EQ(optimizer_seconds(1e9, off, true), 1e9 / 1e10);
  EXPECT_DOUBLE_EQ(optimizer_seconds(1e9, off), 1e9 / 1e11);
  EXPECT_NE(parse_error(std::string(kMinimal) + "[host]\nlink = 1e8\n").find("host"),
            std::string::npos);
}

TEST(Calibrate, QuickWritesALoadableFile) {
  CalibrateOptions opt;
  opt.quick = true;
  opt.name = "quick-test";
  opt.gemm_shapes = {{96, 288, 160, 0}};  // an odd model shape beside the grid
  const Calibration c = calibrate(opt, nullptr, nullptr);
  // Not a speed test (the seconds depend on the CPU and the load; 31 s on an idle 2-core Xeon
  // with AMX, 54 s there while the calibration's loss inputs made its softmax subnormal): a bound
  // far above any machine's time, against a hang or a pathology many times worse.
  EXPECT_LT(c.seconds, 150);
  const std::string text = hardware_toml(c);
  const Hardware hw = parse_hardware(text, "calibrated.toml");
  EXPECT_EQ(hw.name, "quick-test");
  EXPECT_GT(hw.peak_f32, 0);
  EXPECT_GT(hw.peak_bf16, 0);
  EXPECT_FALSE(hw.gemm_f32.empty());
  EXPECT_EQ(hw.gemm_f32.size(), hw.gemm_bf16.size() + 1);
  EXPECT_EQ(hw.gemm_f32.back().n, 288);
  for (const GemmPoint& p : hw.gemm_f32) EXPECT_GT(p.flops_per_s, 0);
  EXPECT_GT(hw.attention_efficiency, 0);
  EXPECT_GT(hw.attention_backward_efficiency, 0);
  EXPECT_GT(hw.attention_bf16_efficiency, 0);
  EXPECT_GT(hw.attention_bf16_backward_efficiency, 0);
  EXPECT_GT(hw.memory_bandwidth, 0);
  EXPECT_GT(hw.optimizer_bandwidth, 0);
  EXPECT_GT(hw.capacity, 0);
  EXPECT_GE(hw.threads, 1);
  for (const char* op : {"rmsnorm_forward", "swiglu_backward", "rope_forward", "cast",
                         "embedding_forward", "linear_cross_entropy"}) {
    ASSERT_TRUE(hw.op_bandwidth.count(op)) << op;
    EXPECT_GT(hw.op_bandwidth.at(op), 0) << op;
  }
}
