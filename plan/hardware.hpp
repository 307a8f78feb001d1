#pragma once
// The hardware model of `loom plan` (../shared/specs/PIPELINE-AND-PLAN.md B3): what one rank's
// machine computes per second and what its links move, read from configs/hardware/*.toml, and the
// time of a kernel (a roofline over ops::KernelWork) or of a collective (ring formulas) on it.
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "ops/ops.hpp"

namespace loom::plan {

// The collectives of dist::ProcessGroup, for the time model.
enum class CollectiveKind {
  all_gather,
  reduce_scatter,
  all_reduce,
  broadcast,
  send,
  recv,
  all_to_all,
  all_to_all_v,
  barrier
};
inline constexpr CollectiveKind kCollectiveKinds[] = {
    CollectiveKind::all_gather, CollectiveKind::reduce_scatter, CollectiveKind::all_reduce,
    CollectiveKind::broadcast,  CollectiveKind::send,           CollectiveKind::recv,
    CollectiveKind::all_to_all, CollectiveKind::all_to_all_v,   CollectiveKind::barrier};
const char* collective_name(CollectiveKind kind);

// One level of interconnect, as seen by one rank.
struct Link {
  double bandwidth = 0;  // bytes/s per rank and direction (beta)
  double latency = 0;    // seconds per message or ring step (alpha)
};

// A GEMM throughput measured at one shape (M x N x K), in FLOP/s.
struct GemmPoint {
  int64_t m = 0, n = 0, k = 0;
  double flops_per_s = 0;
};

struct Hardware {
  std::string name;
  // The device whose kernels the memory plan models: "cpu", or "cuda" (a GPU: its kernels'
  // scratch and cuBLASLt's workspace, ops::ModeledDevice); `loom plan` plans the job on it.
  std::string device = "cpu";
  std::string source;           // the file it was read from, for messages
  double peak_f32 = 0;          // dense FLOP/s with f32 GEMM inputs (GPUs: TF32 tensor cores)
  double peak_bf16 = 0;         // dense FLOP/s with bf16 GEMM inputs
  double memory_bandwidth = 0;  // bytes/s of the rank's memory
  double capacity = 0;          // bytes of memory per rank
  int ranks_per_node = 1;
  Link intra_node, inter_node;
  // A CPU's MPI over shared memory ([links] transfers_on_core): a transfer's copies run on the
  // rank's own core, inside its MPI calls, so a collective never overlaps the rank's compute; a
  // GPU's copy engines and NCCL's kernels do overlap it.
  bool transfers_on_core = false;
  // The wait at a blocking collective for its last member ([links] sync_wait), as a fraction of
  // the rank's compute since its previous one: ranks running the same kernels between two
  // collectives still arrive apart (the machine's other work, shared caches and memory slow one
  // rank now and another then). Measured by calibrate; 0 unless given.
  double sync_wait = 0;
  // Measured per collective within a node ([collectives.NAME]; a CPU's MPI reduces in the
  // cores, so a reduce-scatter moves its bytes slower than an all-gather): overrides intra_node.
  std::map<CollectiveKind, Link> intra_by_kind;
  // A GEMM runs at peak * gemm_efficiency, unless a table of measured shapes exists for its
  // dtype: then at the rate of the nearest measured shape (distance in log M, log N, log K).
  double gemm_efficiency = 1;
  std::vector<GemmPoint> gemm_f32, gemm_bf16;
  // Attention (and the GLA core) runs at its dtype's peak times these; `attention_dtype` set
  // means the device's attention kernels run in that dtype whatever the ops' tensors are (GPU
  // flash kernels run bf16 where loom's cpu kernels take f32).
  double attention_efficiency = 1, attention_backward_efficiency = 1;
  // Ring attention's block-pair kernels (attention_block_*): their own rates where measured
  // (on the CPU they run below the whole-sequence kernels), else the two above.
  double attention_block_efficiency = 1, attention_block_backward_efficiency = 1;
  // Where measured (a CPU's calibration), each of those four kernels also pays its bytes at this
  // rate on top of its FLOPs (bytes/s, 0: the roofline alone): the per-row work that makes short
  // sequences, few heads and ring attention's small blocks slower per FLOP. Order: forward,
  // backward, block forward, block backward.
  std::array<double, 4> attention_bandwidth{};
  // loom's bf16 attention kernels (attention_forward/backward on bf16 tensors: vdpbf16ps where
  // the CPU has it), where measured: their fraction of peak_bf16 and bytes/s, forward and
  // backward (0: the f32 kernels' fractions, of peak_bf16).
  double attention_bf16_efficiency = 0, attention_bf16_backward_efficiency = 0;
  std::array<double, 2> attention_bf16_bandwidth{};
  bool has_attention_dtype = false;
  DType attention_dtype = DType::bf16;
  // Memory-bound ops by their name in ops/ops.hpp: bytes/s (absent: memory_bandwidth).
  std::map<std::string, double> op_bandwidth;
  double optimizer_bandwidth = 0;  // AdamW bytes/s (0: memory_bandwidth)
  // CPU offload ([host]): the link between a rank's device and host memory, one direction, bytes/s
  // (0: none, the host pool is the rank's own memory, as on a CPU), and the host's AdamW over the
  // offloaded states, bytes/s per rank (0: optimizer_bandwidth).
  double host_link_bandwidth = 0;
  double host_optimizer_bandwidth = 0;
  int threads = 0;  // OpenMP threads per rank the figures were measured with (0: not measured)

  double peak(DType dt) const { return dt == DType::bf16 ? peak_bf16 : peak_f32; }
};

// Reads a hardware file: a bare NAME means configs/hardware/NAME.toml (searched in ./configs,
// $LOOM_SOURCE_DIR/configs and beside the executable, as model configs are), anything else a
// path. Unknown or missing keys, wrong types and non-positive figures are errors naming the key
// and the file.
Hardware load_hardware(const std::string& name_or_path);
Hardware parse_hardware(const std::string& toml_text, const std::string& source);

// The FLOP/s of a GEMM of this shape and dtype.
double gemm_rate(const Hardware& hw, DType dt, int64_t m, int64_t n, int64_t k);
// Roofline: max(flops / achievable FLOP/s, bytes / bandwidth, link bytes / host link bandwidth).
double kernel_seconds(const ops::KernelWork& w, const Hardware& hw);
// The AdamW step over `bytes` of parameters, gradients and moments read and written, on the
// device or (`on_host`: CPU offload) on the host.
double optimizer_seconds(double bytes, const Hardware& hw, bool on_host = false);
// A collective over `group_size` ranks with ring algorithms; `bytes_sent` is one rank's count in
// dist::ProcessGroup's convention (process_group.hpp): (n-1)·in for all_gather, (n-1)·out for
// reduce_scatter, 2(n-1)/n·t for all_reduce; for broadcast, send and recv the message's size. The
// link is the slowest the group spans: inter_node when it spans nodes (`node_ranks` > 0: that
// many of the group's ranks on each node). inter_node's bandwidth is one rank's NIC; a
// collective across nodes runs one ring per NIC (NCCL's channels on a rail-optimized fabric),
// so it moves node_ranks NICs' worth, at most the intra-node link's; a send uses one NIC. An
// all-to-all is no ring: across nodes the share of its bytes for the other nodes' ranks,
// (n - node_ranks) / (n - 1), goes through the rank's own NIC, beside the rest on the node's link.
//   all_gather, reduce_scatter, all_to_all(_v) within a node: bytes/beta + (n-1) alpha
//   all_to_all(_v) across nodes: max(bytes x (n - r) / (n - 1) / NIC, bytes x (r - 1) / (n - 1) /
//     intra-node beta) + (n-1) alpha, r = node_ranks
//   all_reduce (reduce-scatter then all-gather): bytes/beta + 2(n-1) alpha
//   broadcast (pipelined ring): bytes/beta + (n-1) alpha
//   send, recv: alpha + bytes/beta;  barrier: ceil(log2 n) alpha
double collective_seconds(CollectiveKind kind, uint64_t bytes_sent, int group_size, int node_ranks,
                          const Hardware& hw);

}  // namespace loom::plan
