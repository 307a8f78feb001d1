#pragma once
// [metrics] tensorboard: a run's metrics as TensorBoard event files in one directory
// (`tensorboard --logdir DIR`), written by world rank 0 alone. Per step the scalars loss, lr,
// grad_norm, tokens_per_s, mfu and peak_allocated_bytes, per validation val_loss (metrics.jsonl's
// keys as tags, the same values as float32), and the resolved configuration as a text summary
// ("config", TOML in a Markdown code block). The events (train/tensorboard_event.proto) are
// framed as TFRecords (train/tfrecord.hpp), each flushed when written, so TensorBoard can follow
// the run and the file is whole up to the last step if the run dies.
//
// A fresh run writes a new file and first removes the directory's event files (the run's claim,
// train/run_claim.hpp, refused them unless metrics.overwrite). A run resumed from step R keeps the
// events of steps <= R in the existing files, drops those of later steps (logged after the
// checkpoint, and about to be redone) and a torn last record, and starts a new file, named to
// sort after the others (TensorBoard reads a run's files in name order), with a session START at
// step R + 1: a TensorBoard that already read the dropped steps purges them.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "train/metrics.hpp"

namespace loom {

class TensorBoardWriter {
 public:
  struct Options {
    std::string dir;  // created if missing
    // The step a resumed run continues after (its checkpoint's); -1: a fresh run.
    int64_t resume_step = -1;
    // The resolved configuration (to_toml), written as text at the run's first step: step 0 for a
    // fresh run, R + 1 for a resume (a resume may change keys; steps <= R are never rewritten).
    std::string config_toml;
  };
  // loom::Error naming the directory or file when it cannot be prepared or written.
  explicit TensorBoardWriter(const Options& options);
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Both throw loom::Error, naming the file, when the event cannot be written.
  void step(const StepMetrics& m);
  void validation(int64_t step, double val_loss);

  const std::string& path() const { return path_; }  // the file this run writes

 private:
  void write(const std::string& event);
  struct FileCloser {
    void operator()(FILE* f) const { std::fclose(f); }
  };
  std::string path_;
  std::unique_ptr<FILE, FileCloser> file_;
};

// The event files of `dir` (file names holding "tfevents", TensorBoard's rule), sorted by name;
// none when `dir` does not exist.
std::vector<std::string> tensorboard_event_files(const std::string& dir);

// How many events of scalars (steps and validations) the files hold and the highest step among
// them (-1 when none), counting the whole records before a torn or corrupt one.
struct TensorBoardHistory {
  int64_t events = 0;
  int64_t last_step = -1;
};
TensorBoardHistory tensorboard_history(const std::vector<std::string>& files);

}  // namespace loom
