#pragma once
// The trainer: the loop of docs/architecture.md "The path of one training step" on one rank
// (data loader -> micro-batches -> forward/backward -> clip -> AdamW -> lr schedule -> metrics ->
// checkpoint), on one process or on the data-parallel ranks of a mesh (TrainerOptions::mesh).
// The data loader and the loss normalization follow the layout-free rules of decision 11. The
// step itself (micro-batches, reductions, clip, AdamW) is train/step.hpp's, the model and its
// parallel hooks parallel/parallelize.hpp's, how a checkpoint is saved (sync or async)
// train/checkpoint_saver.hpp's; the trainer keeps the policy around them (logging, validation,
// when to save, stopping).
//
// Everything that can be wrong with the job (the config, the model shape, the data directory and
// its vocabulary, the checkpoint directory, the memory the run needs) is checked in the
// constructor before anything large is allocated.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.hpp"
#include "model/model.hpp"
#include "model/model_config.hpp"
#include "train/config.hpp"

namespace loom {

class AdamW;
namespace dist {
class Mesh;
}

struct TrainerOptions {
  FILE* out = stdout;  // progress and messages
  bool tty = false;    // a live progress line instead of plain lines
  // Set asynchronously (SIGINT/SIGTERM): the current step finishes, a checkpoint is saved if a
  // directory is configured, and run() returns with interrupted = true.
  const std::atomic<bool>* stop = nullptr;
  double gemm_peak_seconds = 0.2;  // measurement of the GEMM peak for MFU; 0: skip (mfu = 0)
  size_t mem_available = 0;        // bytes the run may use; 0: MemAvailable from /proc/meminfo
  // The device mesh of a multi-process run (not owned; must outlive the trainer); nullptr: one
  // process. dp_shard > 1 trains with FSDP (HSDP when dp_replicate > 1 too), dp_replicate > 1
  // alone with DDP. World rank 0 prints, writes metrics and checkpoints.
  dist::Mesh* mesh = nullptr;
  // This rank's own log ([job] rank_logs; not owned): progress lines and messages go there too,
  // as plain lines, on every rank.
  FILE* rank_log = nullptr;
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
};

struct TrainResult {
  std::vector<StepRecord> steps;                       // the steps run by this call
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, val_loss)
  int64_t final_step = 0;
  bool interrupted = false;
  std::string last_checkpoint;  // "" if none was saved by this call
};

// The memory one rank of a training run needs: its step run on the meta device (plan_rank,
// train/rank_plan.hpp, whose figures `loom bench --check` finds equal to a real step's), as the
// pre-flight reports it; the parts are the allocator's uses (core/allocator.hpp) at the step's
// peak.
struct MemoryEstimate {
  size_t params = 0;       // number of parameters (the whole model's)
  size_t states = 0;       // this rank's f32 master weights and gradients (shards), the bf16 copies
  size_t optimizer = 0;    // AdamW moments
  size_t activations = 0;  // saved activations and the ops' temporaries (MemoryUse::work)
  // FSDP's gathered units and full gradients, communication buffers, the loss's workspace.
  size_t workspace = 0;
  // CPU offload: the weights, gradients and moments of the offloaded shards, in host memory (not
  // in total(), which is the device's).
  size_t host = 0;
  size_t peak = 0;  // the run's peak (the first step's, with a cold cache, may be the larger)
  size_t total() const { return peak; }
};
// One process.
MemoryEstimate estimate_training_memory(const JobConfig& job, const ModelConfig& c);
size_t mem_available_bytes();  // MemAvailable of /proc/meminfo (0 if it cannot be read)

class Trainer {
 public:
  explicit Trainer(const JobConfig& config, const TrainerOptions& options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains from the current step to training.steps. A non-finite loss or gradient norm stops the
  // run with a loom::Error naming the step; nothing is saved from that state.
  TrainResult run();
  // Mean cross-entropy over the fixed validation batches (validation.steps batches of the `val`
  // split). Leaves the gradients zero.
  double validate();

  Model& model();
  AdamW& optimizer();
  int64_t step() const;  // optimizer steps completed

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace loom
