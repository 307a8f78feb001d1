#pragma once
// Parallelize: the one place a model is made parallel, in torchtitan's visible order, each a named
// step of parallelize.cpp:
//   apply_tp    tensor (+ sequence) parallelism by the model's plan (Model::tp_plan)
//   apply_cp    context parallelism (ring attention over the cp group)
//   apply_ac    activation checkpointing
//   apply_fsdp  FSDP over dp_shard x cp (HSDP when dp_replicate > 1 too), or
//   apply_ddp   DDP when only dp_replicate > 1
//   apply_pp    the pipeline schedule and this rank's stages (parallel/pipeline_executor.hpp)
// The model (model/model.hpp: Llama or GLA, by the config's model_type) takes its tp and cp
// options when it is built (each unit holds its tp slices), so apply_tp and apply_cp give the
// options the model is built with (each model splits its parameters by its own plan,
// model/tp_plan.hpp) and the built model is checked against that plan; activation checkpointing and
// the data-parallel hooks apply to it afterwards.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/dtype.hpp"
#include "model/model.hpp"
#include "model/model_config.hpp"
#include "parallel/ddp.hpp"
#include "parallel/fsdp.hpp"
#include "parallel/parallel_dims.hpp"
#include "parallel/pipeline_executor.hpp"

namespace loom {

// The [parallelism] and [activation_checkpoint] choices, as values.
struct ParallelizeOptions {
  bool sequence_parallel = true;  // tp_sequence_parallel
  bool tp_recompute_allgather = false;
  bool tp_async = false;
  bool cp_allgather = false;  // cp_rotate_method = "allgather" (else p2p)
  ActivationCheckpoint ac;
  parallel::FsdpConfig fsdp;  // reshard policy and reduce dtype (DDP reduces in the same dtype)
  Device device = Device::cpu;
  // training.enable_cpu_offload: FSDP's shards and the optimizer's moments in host memory
  // (ShardLayout::offload); needs a shard group.
  bool cpu_offload = false;
  // Pipeline parallelism (used when groups.pp is set): the schedule by name or from a CSV file,
  // its micro-batches and stages per rank (resolved, not 0), the blocks per stage ("" balanced).
  std::string pp_schedule = "1f1b";
  std::string pp_schedule_csv;
  std::string pp_stage_layers;
  int pp_microbatches = 1;
  int pp_stages_per_rank = 1;
  // With FSDP: "microbatch" (gather and reduce-scatter per action) or "step" (once per step).
  std::string pp_fsdp_gather = "microbatch";
};

// This rank's tokens of a micro-batch (owned: a pipeline round outlives the caller's batch).
struct LocalBatch {
  int64_t B = 0, T = 0;                  // T: this rank's tokens per sample
  std::vector<int32_t> inputs, targets;  // [B, T]
  MicroBatchView view() const { return {inputs.data(), targets.data(), B, T}; }
};

// The model of one rank with its parallel hooks.
struct ParallelModel {
  ParallelGroups groups;
  std::unique_ptr<Model> model;  // declared first: the hooks detach from it on destruction
  std::unique_ptr<parallel::Fsdp> fsdp;
  std::unique_ptr<parallel::Ddp> ddp;
  // With pp: this rank's stages and action list, and the FSDP or DDP glue as its hooks.
  std::unique_ptr<PipelineExecutor> pipeline;

  // This rank's tokens of a global [B, T] micro-batch: with cp its zigzag chunks
  // (cp_local_batch), all of them without.
  LocalBatch local_batch(const MicroBatchView& mb) const;
  // One micro-batch of the global [B, T] batch (`last`: the last of the step, the one DDP
  // reduces on): with cp this rank takes its tokens (local_batch); returns the summed loss
  // of the tokens of this rank's samples (summed over cp).
  double forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale, bool last);
  // The forward and backward of a step's micro-batches 0..n-1 (`batch(m)` valid until its next
  // call): forward_backward of each, or, with pp, rounds of the schedule's micro-batches (n a
  // multiple of them). Returns the summed loss of this rank's samples (summed over cp; with pp
  // on the head's rank only, 0 elsewhere).
  double forward_backward_step(int64_t n, const std::function<MicroBatchView(int64_t)>& batch,
                               float grad_scale);
  // After the step's last micro-batch, before the norm: every gradient reduction complete (with
  // pp, the tied embedding's two copies summed).
  void finish_step();
  // Per unit, whether this rank counts its gradient in the norm (empty: every unit it holds).
  std::vector<bool> counted_units() const;
  // Validation: the summed loss of the micro-batches over this dp rank's tokens (summed over cp
  // and pp, the same on every rank of the dp coordinate), a forward-only schedule under pp; the
  // (zero) gradients cleared.
  double validation_loss(int64_t n, const std::function<MicroBatchView(int64_t)>& batch);
  // "FSDP", "HSDP", "DDP" or "single".
  const char* kind() const;
};

// The model is allocated (sharded over groups.shard) but not initialized.
ParallelModel parallelize(const ModelConfig& config, DType compute, const ParallelGroups& groups,
                          const ParallelizeOptions& options);

// This cp rank's tokens of a [B, T] batch: the zigzag layout's chunks r and 2*cp-1-r of every
// sample (cp_positions; with SP over `sp_tp` ranks each chunk pair split further).
LocalBatch cp_local_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                          int cp, int cp_rank, int sp_tp);

}  // namespace loom
