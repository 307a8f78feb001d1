#pragma once
// The Llama model as explicit modules (DESIGN.md decision 1): each forward saves exactly what its
// backward needs in the micro-batch's activation store, each backward returns the input gradient
// and accumulates parameter gradients. The saved tensors are the activation memory.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "distributed/buffer_pool.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/rope.hpp"
#include "model/llama_config.hpp"
#include "model/param_unit.hpp"

namespace loom {

class SafetensorsDir;
namespace dist {
class ProcessGroup;
}

// Tensor parallelism (DESIGN.md decision 5; docs/design.md "Tensor parallelism").
struct TpOptions {
  dist::ProcessGroup* group = nullptr;  // the mesh's "tp" group; nullptr: none
  bool sequence_parallel = true;        // shard the B*T rows outside attention and the MLP
  bool recompute_allgather = false;     // all-gather a GEMM input again in backward
  // "Async TP": with SP, the forward all-gather before q/k/v and gate/up runs while the GEMM of
  // this rank's own rows (which need no gather) is computed in chunks, driving MPI between them.
  bool async = false;
  int size() const;
  int rank() const;
};

// Context parallelism (docs/design.md "Context parallel"): the sequence of every sample is cut
// into 2*cp chunks, cp rank r holds chunks r and 2*cp-1-r (cpu::cp_positions); attention runs as
// ring attention over the group (K/V rotate by send/recv, or one all-gather).
struct CpOptions {
  dist::ProcessGroup* group = nullptr;  // the mesh's "cp" group; nullptr: none
  bool allgather = false;               // parallelism.cp_rotate_method = "allgather"
  int size() const;
  int rank() const;
};

// What a block needs for tensor and context parallelism at run time (null group: none).
struct TpRuntime {
  TpOptions opt;
  CpOptions cp;
  dist::BufferPool* pool = nullptr;
  bool on() const { return opt.size() > 1; }
  bool sp() const { return on() && opt.sequence_parallel; }
};

// Indices of a block's parameters in its unit: q, k, v adjacent (read as one fused GEMM
// matrix), gate and up adjacent (likewise).
enum BlockParam { kNorm1, kQ, kK, kV, kO, kNorm2, kGate, kUp, kDown };

// What one forward/backward of a micro-batch needs to know.
struct StepContext {
  int64_t B = 0, T = 0;
  DType compute = DType::f32;      // what GEMMs read: f32, or bf16 (fp32 accumulation)
  std::vector<int32_t> positions;  // global position of each of the T tokens
  // With context parallelism: T is this rank's length (T_global / cp) and cp_pos[r] holds the
  // global positions of cp rank r's T tokens (positions is cp_pos[own rank]).
  std::vector<std::vector<int64_t>> cp_pos;
  const cpu::RopeTable* rope = nullptr;
  int64_t tokens() const { return B * T; }
};

// Activation checkpointing (DESIGN.md decision 8; docs/design.md "Activation checkpointing"):
// what a block's forward saves versus what its backward recomputes. Recomputation runs the same
// deterministic kernels on the same inputs, so every mode gives bit-identical results.
struct ActivationCheckpoint {
  enum class Mode {
    none,  // save everything
    full,  // save the block input only; backward re-runs the block's forward first
    op,    // save GEMM and attention outputs; recompute the norm and SwiGLU outputs they read
  };
  Mode mode = Mode::none;
  int every_n = 1;  // full: only blocks with layer % every_n == 0; the others save everything
  // [activation_checkpoint] mode ("none", "full", "selective") and selective_option ("op" or a
  // positive N: every N-th block full); anything else is a loom::Error.
  static ActivationCheckpoint parse(const std::string& mode, const std::string& selective_option);
  Mode block_mode(int64_t layer) const;
  bool operator==(const ActivationCheckpoint&) const = default;
};

// Saved activations of one transformer block.
struct BlockActs {
  Tensor x;      // block input [M, d]
  Tensor rstd1;  // [M]
  Tensor xn1;    // attention norm output, as the GEMM reads it [M, d]
  Tensor qkv;    // after RoPE [M, (Hq + 2 Hkv) hd]
  Tensor attn;   // attention output [M, Hq hd] (f32)
  Tensor lse;    // [B, Hq, T]
  Tensor h;      // after the attention residual [M, d]
  Tensor rstd2;  // [M]
  Tensor xn2;    // MLP norm output, as the GEMM reads it [M, d]
  Tensor gu;     // gate and up projections [M, 2F]
  Tensor act;    // silu(gate) * up, as the GEMM reads it [M, F]
  // Checkpointing leaves some undefined: `full` keeps x only, `op` drops xn1, xn2 and act.
  size_t bytes() const;
};

class TransformerBlock {
 public:
  TransformerBlock(const LlamaConfig& c, int64_t layer, bool bf16, Device device,
                   ShardLayout shard = {}, const TpRuntime* tp = nullptr);
  ParamUnit& unit() { return unit_; }
  const ParamUnit& unit() const { return unit_; }
  // What forward saves (none, full or op; see ActivationCheckpoint).
  void set_checkpoint(ActivationCheckpoint::Mode mode) { ac_ = mode; }

  // x [M, d] -> output [M, d] (a new tensor); saves into `acts`. With sequence parallelism x and
  // the output hold this tp rank's M / tp rows.
  Tensor forward(const StepContext& ctx, const Tensor& x, BlockActs& acts) const;
  // dy [M, d] (gradient w.r.t. the block's output) is turned in place into the gradient w.r.t.
  // the block's input; parameter gradients accumulate. Recomputes what forward did not save
  // (with tp or cp that re-runs their communication), then frees `acts`.
  void backward(const StepContext& ctx, Tensor& dy, BlockActs& acts);

 private:
  // `mode` says what to keep in `acts`; without `output` the down projection is skipped (the
  // recomputation of a `full` block needs everything but the output) and an empty tensor
  // returned.
  Tensor run_forward(const StepContext& ctx, const Tensor& x, BlockActs& acts,
                     ActivationCheckpoint::Mode mode, bool output) const;

  const LlamaConfig& c_;
  const TpRuntime* tp_;
  ParamUnit unit_;
  ActivationCheckpoint::Mode ac_ = ActivationCheckpoint::Mode::none;
};

// Called by LlamaModel::forward_backward around the work of each unit, unit i in units() order
// (embedding, blocks, head). Data parallelism (parallel/) implements it: gathering sharded
// weights before a unit runs, reducing its gradient after its backward. The head's forward and
// backward are one fused computation: its after_forward is directly followed by its
// before_backward. With tied embeddings the head also reads and writes unit 0 (the embedding)
// between its before_backward and after_backward.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(size_t unit) = 0;
  virtual void after_forward(size_t unit) = 0;
  virtual void before_backward(size_t unit) = 0;
  virtual void after_backward(size_t unit) = 0;
};

// The whole model: embedding unit, blocks, head unit (final norm + lm_head, or the embedding
// when tied). With a sharded layout every unit is sharded over `shard.count` ranks (see
// param_unit.hpp); forward_backward then needs hooks that materialize the units.
class LlamaModel {
 public:
  // With tensor parallelism each unit holds this tp rank's slices of the parameters (global
  // names, local shapes; ParamSpec::split); a config whose heads, kv heads, ffn size or
  // vocabulary tp does not divide is refused.
  LlamaModel(const LlamaConfig& config, DType compute, Device device = Device::cpu,
             ShardLayout shard = {}, TpOptions tp = {}, CpOptions cp = {});

  const LlamaConfig& config() const { return config_; }
  DType compute_dtype() const { return compute_; }
  std::vector<ParamUnit*> units();
  int64_t num_params() const;

  const ShardLayout& shard_layout() const { return shard_; }
  const TpOptions& tp() const { return tp_->opt; }
  size_t comm_buffer_bytes() const { return pool_.bytes(); }
  // Not owned; nullptr for none. Must outlive the calls of forward_backward.
  void set_hooks(UnitHooks* hooks) { hooks_ = hooks; }
  // Activation checkpointing of every block (default: none).
  void set_activation_checkpoint(const ActivationCheckpoint& ac);
  const ActivationCheckpoint& activation_checkpoint() const { return ac_; }

  void init_weights(uint64_t seed);
  // Every parameter, shapes checked; a sharded model reads only its shards' slices.
  void load_hf(const SafetensorsDir& dir);
  void zero_grad();

  const CpOptions& cp() const { return tp_->cp; }

  // Forward and backward of one micro-batch: inputs/targets [B, T]. With context parallelism
  // they are this cp rank's tokens (T = seq_len / cp, at positions cpu::cp_positions). Returns the
  // sum of the per-token losses; gradients of (grad_scale * that sum) accumulate into the units.
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale);

  // Bytes of activations one micro-batch holds at its peak (the analytic figure of the memory
  // model): without checkpointing every block's saved tensors; with it, the larger of what the
  // blocks save and, for the last block recomputed in backward, what the blocks before it save
  // plus that block's recomputed tensors. With tensor parallelism (tp ranks, sequence parallel,
  // recompute_allgather): one tp rank's.
  static size_t saved_activation_bytes(const LlamaConfig& c, int64_t B, int64_t T, DType compute,
                                       int tp = 1, bool sp = false, bool recompute = false,
                                       const ActivationCheckpoint& ac = {});
  // Bytes this rank sends on the tp group in one micro-batch (the analytic figure).
  uint64_t tp_bytes_per_micro_batch(int64_t B, int64_t T) const;
  // Bytes this rank sends on the cp group in one micro-batch of T tokens per sample on this rank
  // (ring attention's K/V, and dK/dV in backward; the analytic figure).
  uint64_t cp_bytes_per_micro_batch(int64_t B, int64_t T) const;
  // Ring attention's working set in a block's backward, the largest it holds (0 without cp):
  // K/V blocks and dK/dV accumulators (p2p: the block in hand, the one arriving, the partial
  // sum, the accumulator arriving and the one leaving; allgather: all cp blocks, their dK/dV,
  // this rank's sum) and Di.
  size_t ring_working_bytes(int64_t B, int64_t T) const;
  // Rows per chunk of the fused output projection + loss.
  static int64_t loss_chunk_rows(const LlamaConfig& c, int64_t B, int64_t T, DType compute);

 private:
  const cpu::RopeTable& rope_for(int64_t T);
  double vocab_parallel_cross_entropy(const cpu::LinearCrossEntropyArgs& a, int64_t v0);
  // Embedding / output rows on each of `tp` ranks: the vocabulary padded to a multiple of tp.
  int64_t local_vocab(int tp) const { return (config_.vocab_size + tp - 1) / tp; }
  int64_t recomputed_blocks() const;  // blocks whose forward runs again in backward (full)
  size_t ring_kv_bytes(int64_t B, int64_t T) const;  // one ring attention K/V block

  LlamaConfig config_;
  DType compute_;
  Device device_;
  ShardLayout shard_;
  dist::BufferPool pool_;
  std::unique_ptr<TpRuntime> tp_;  // stable address: the blocks point at it
  UnitHooks* hooks_ = nullptr;
  ActivationCheckpoint ac_;
  std::unique_ptr<ParamUnit> embed_;
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;
  std::unique_ptr<ParamUnit> head_;
  cpu::RopeTable rope_;
};

}  // namespace loom
