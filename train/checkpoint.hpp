#pragma once
// Training checkpoints (docs/decisions/distributed-checkpoints.md). A checkpoint is a directory
// ROOT/step-00000100/ holding
//   rank-0000r.safetensors  each writing rank's slices of the f32 master weights and of the AdamW
//                           moments ("<name>", "<name>.exp_avg", "<name>.exp_avg_sq"), written
//                           by that rank from its own shards (no rank gathers the model); ranks
//                           that hold the same slices as a lower rank (replicas) write nothing;
//   loom.index.json         every tensor's global shape and dtype and which slice each file holds;
//                           every other file's checksum (model/checksum.hpp) but state.json's;
//   config.json             the Hugging Face model config;
//   state.json              step, data loader step, lr and loss of the last step, the resolved
//                           job config (TOML), the index's checksum and its own: written last,
//                           the completion marker;
//   tokenizer.json          copied from the data directory when there is one.
// SafetensorsDir reads it like a Hugging Face directory (`loom generate`, `[model] init_from`).
// Saving is atomic: every rank writes and fsyncs its file into step-00000100.tmp (hashing it as it
// writes), then world rank 0 writes the config, the index and state.json, fsyncs the directory
// and renames it. Only
// names step-<digits> with a state.json are checkpoints, so a .tmp left by a crash is ignored
// (and removed by clean_checkpoint_dir or the next save of that step).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.hpp"

namespace loom {

class Model;
class AdamW;
namespace dist {
class ProcessGroup;
}

// The ranks a checkpoint is saved from. `world`: all ranks (nullptr: one process); after each
// phase of a save every rank learns every rank's failure (a failed save is an error on every
// rank, naming the failing ranks' causes). `shard` and `tp` are not needed by the sharded save
// (each rank writes what it holds) and kept for callers.
struct CheckpointComm {
  dist::ProcessGroup* shard = nullptr;
  dist::ProcessGroup* world = nullptr;
  dist::ProcessGroup* tp = nullptr;  // tensor parallelism: slices gathered to global tensors
  // Pipeline parallelism: the units of this rank's stages, ascending; every pp rank holds every
  // unit but keeps only these up to date, and writes only these. Empty: every unit.
  std::vector<size_t> units = {};
};
struct TrainState {
  int64_t step = 0;       // optimizer steps completed
  int64_t data_step = 0;  // the data loader's next step (0-based)
  double lr = 0;          // learning rate of the last step
  double loss = 0;        // loss of the last step
  std::string config_toml;
  // Tokens per optimizer step over all ranks (the global batch); 0 in checkpoints that predate
  // it. A resume compares it, since local_batch_size alone depends on the layout.
  int64_t tokens_per_step = 0;
};

std::string checkpoint_name(int64_t step);  // "step-00000100"

// The complete checkpoints (step-<digits> directories holding state.json) under `root`, by
// increasing step (empty if root does not exist).
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& root);
std::string latest_checkpoint(const std::string& root);  // "" if there is none

// Writes ROOT/step-<state.step>/ atomically (replacing one of the same step) and returns its path.
// `tokenizer_json`: a file to copy as tokenizer.json ("" for none).
// Every rank of `comm` calls it. Each rank holds nothing beyond its own shards: its file is
// written from views of them.
std::string save_checkpoint(const std::string& root, Model& model, AdamW& optimizer,
                            const TrainState& state, const std::string& tokenizer_json = "",
                            const CheckpointComm& comm = {});

// `[checkpoint] async = true`: the collective start of the save happens here, and returns; a
// background thread writes this rank's file straight from its live shards, and on world rank 0
// completes the checkpoint (index, state.json, rename) once every rank's file is there, then runs
// `after_complete` (the prune). Nothing may change the shards (the optimizer step, a load) before
// before_modify() (or wait()) has returned: it copies what the thread has not written yet into
// `staging`, from which the thread then writes, so the file holds the shards as they were at the
// save (the training stall is the agreement here plus that copy, often nothing). wait() joins
// and tells every rank every rank's failure (an error on every rank, as save_checkpoint); every
// rank must call it (the next save and the end of training do) before any other save.
// Destroying it without wait() (an error unwinding) stops waiting for other ranks and joins.
// `staging`: an f32 buffer the copy goes into when it is large enough (a caller's, allocated
// once), else before_modify allocates one the size of what it copies.
class PendingSave {
 public:
  struct Impl;
  explicit PendingSave(std::unique_ptr<Impl> impl);
  ~PendingSave();
  PendingSave(const PendingSave&) = delete;
  PendingSave& operator=(const PendingSave&) = delete;
  const std::string& path() const;  // the checkpoint's directory once complete
  // Returns the bytes it copied (0 when the thread had written everything, or on a second call).
  size_t before_modify();
  std::string wait();  // returns path()

 private:
  std::unique_ptr<Impl> impl_;
};
std::unique_ptr<PendingSave> save_checkpoint_async(const std::string& root, Model& model,
                                                   AdamW& optimizer, const TrainState& state,
                                                   const std::string& tokenizer_json = "",
                                                   const CheckpointComm& comm = {},
                                                   std::function<void()> after_complete = {},
                                                   const Tensor& staging = {});

// Test hooks of the async save's writer thread (process-wide; tests only).
struct AsyncSaveTesting {
  bool skip_copy = false;  // before_modify copies nothing: the thread reads the changed shards
  size_t piece_bytes = 0;  // the bytes the thread writes at a time (0: 4 MiB)
  // Called by the thread before each piece with the number written so far (a test holds the
  // thread at a chosen point with it).
  std::function<void(int64_t)> before_piece;
};
AsyncSaveTesting& async_save_testing();

// Restores the weights, the optimizer moments and step count, and returns the state. Errors name
// the file: missing or corrupt files, a tensor whose shape differs from the model's (with both
// shapes), tensors the model does not have. Each rank reads only the slices it holds from
// whichever files have them, so a checkpoint of any layout loads into any other. Checkpoints of
// the earlier format (model.safetensors + optimizer.safetensors) load too.
// `units` (pipeline parallelism: the rank's stages' units, ascending; empty: every unit): only
// these are read, the others' weights and moments are zeroed (the rank never uses them).
// `verify`: verify_checkpoint first, by this caller alone (it reads every file); the trainer
// verifies with its ranks sharing the reads (choose_resume_checkpoint) and passes false.
TrainState load_checkpoint(const std::string& dir, Model& model, AdamW& optimizer,
                           const std::vector<size_t>& units = {}, bool verify = true);
// Only the state.json of a checkpoint (errors name the file): what a resume checks before
// allocating anything. `verify`: state.json's own checksum too, where it records one.
TrainState read_checkpoint_state(const std::string& dir, bool verify = true);

// Checksums (docs/decisions/distributed-checkpoints.md): state.json records its own and the
// index's, the index every other file's. Checks, every rank of `world` (nullptr: this caller
// alone) calling it, a checkpoint's structure (state.json, the index, the files it lists and
// their headers: small reads, on every rank) and then every file against its checksum, each file
// read by one rank (the largest first, to the rank with the fewest bytes). Every rank returns the
// same: each rank's findings are gathered.
struct CheckpointCheck {
  // "" when all is well; else one line per finding, each naming the file (and, for a checksum
  // mismatch, the expected and the found checksum).
  std::string error;
  bool checksums = false;  // whether it records checksums (false: saved before loom wrote them)
};
CheckpointCheck check_checkpoint(const std::string& dir, dist::ProcessGroup* world = nullptr);
// check_checkpoint as an error: "checkpoint DIR is corrupt", what was found, and the previous
// complete checkpoint beside it (or that there is none). A directory that is no loom checkpoint
// (a Hugging Face one: neither state.json nor loom.index.json) is left alone. Returns a note
// for the user when the checkpoint records no checksums (it was not verified), else "".
std::string verify_checkpoint(const std::string& dir, dist::ProcessGroup* world = nullptr);

// The checkpoint a resume loads: the latest complete one under `root` ("" if none). `verify`:
// checked first (check_checkpoint, collectively over `world`; every rank must call this and all
// decide the same); a corrupt one is an error naming the previous complete checkpoint, unless
// `fallback`: then it is skipped with a note and the one before it is checked, down to the
// first (an error when every one is corrupt). `notes`: those, and one for a checkpoint without
// checksums.
struct ResumeChoice {
  std::string dir;
  std::vector<std::string> notes;
};
ResumeChoice choose_resume_checkpoint(const std::string& root, bool verify, bool fallback,
                                      dist::ProcessGroup* world = nullptr);

// The parts of a save, for tools that write a checkpoint without a model (loom convert): the
// name of rank r's file, the index of the rank files `ranks` in `dir` (`moments`: whether they
// hold the AdamW moments; `checksums`: of each file of `dir` but the index and state.json, every
// rank file's included, as the writers returned them) returning its own checksum, and
// state.json, the completion marker (fsynced, with the directory), recording `index_checksum`.
std::string checkpoint_rank_file(int rank);  // "rank-00003.safetensors"
uint64_t write_checkpoint_index(const std::string& dir, const std::vector<int>& ranks, int64_t step,
                                bool moments, const std::map<std::string, uint64_t>& checksums);
void write_checkpoint_state(const std::string& dir, const TrainState& state,
                            uint64_t index_checksum);

// Deletes all but the newest `keep` complete checkpoints (keep = 0: keeps all). Each is renamed
// to step-N.deleting before it is deleted.
void prune_checkpoints(const std::string& root, int64_t keep);

// Tidies what interrupted saves and prunes leave under `root`: step-N.tmp, step-N.deleting and
// step-N directories without state.json are removed; step-N.old is put back as step-N when a
// replacing save died before the new one took its place, removed otherwise. Returns one line
// per thing done, for the log.
std::vector<std::string> clean_checkpoint_dir(const std::string& root);

}  // namespace loom
