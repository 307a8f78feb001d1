#pragma once
// The trainer's checkpoint saves ([checkpoint] of the job), synchronous or, with
// checkpoint.async, started here and written by train/checkpoint.hpp's PendingSave in the
// background while the next steps train. The saver owns what an async save needs around it: the
// staging buffer (allocated once, its pages touched by a thread while the first steps run), the
// save in flight (the next save and finish() wait for it), and its stall accounting (the training
// thread's time in the save plus in the copy before the next optimizer update, one stats line for
// both). The trainer decides when to save; the saver how.
//
// A save resets the allocator's peak to measure its own memory ("checkpoint stats" lines, read by
// bench/ckpt_bench.sh from the rank logs): the run's peak across those resets is peak_allocated().
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "core/tensor.hpp"
#include "train/checkpoint.hpp"

namespace loom {

class Allocator;
class Error;

// The bytes of this rank's shards a checkpoint holds: f32 master weights and both AdamW moments.
size_t checkpoint_shard_bytes(Model& model, AdamW& optimizer);

// One rank's memory and time for a save, a load or a verification, as the "checkpoint stats:"
// line of "key=value" fields that bench/ckpt_bench.sh reads: `held` the bytes allocated before,
// `peak` the allocator's peak during it, `staging` the async save's staging copy (0 otherwise).
std::string checkpoint_stats(const char* what, int rank, double seconds, size_t held, size_t shards,
                             size_t peak, size_t staging);

class CheckpointSaver {
 public:
  struct Options {
    std::string dir;  // checkpoint.dir ("": save() does nothing)
    int64_t keep = 0;
    bool async = false;
    bool prunes = false;    // world rank 0: prunes to `keep` after each save
    int rank = 0;           // the world rank, in the stats lines
    std::string each_size;  // one checkpoint's size as text, for the message of a full disk
    std::string tokenizer_json;
    CheckpointComm comm;
    size_t run_peak = 0;  // the allocator's peak before its last reset (by a resume's load)
  };
  // `log`: the run's message lines (the save's, the stall's, the stats).
  CheckpointSaver(Options options, Model& model, AdamW& optimizer, Allocator& alloc,
                  std::function<void(const std::string&)> log);
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Saves `state` as the checkpoint of step state.step (once per step; nothing without a
  // directory), after the save in flight. A full disk is an error saying how much room
  // checkpoint.dir needs.
  void save(const TrainState& state);
  // Before the optimizer changes the shards: the save in flight copies what it has not written.
  void before_update();
  // Waits for the save in flight (the end of training).
  void finish();

  size_t peak_allocated() const;                // the run's peak, across the saves' resets
  const std::string& last_checkpoint() const {  // "" if none was saved
    return last_checkpoint_;
  }
  int64_t last_saved() const { return last_saved_; }  // the step of the last save; -1: none

 private:
  [[noreturn]] void explain_save_error(const Error& e) const;
  void log_stall(bool updated, double copy_s, size_t copied);

  Options o_;
  Model& model_;
  AdamW& optimizer_;
  Allocator& alloc_;
  std::function<void(const std::string&)> log_;
  size_t run_peak_;  // the allocator's peak before its last reset
  std::string last_checkpoint_;
  int64_t last_saved_ = -1;
  // Declared before pending_, whose thread may read the staging buffer.
  Tensor staging_;
  size_t staging_bytes_ = 0;  // its block as the allocator booked it
  std::jthread prefault_;
  std::unique_ptr<PendingSave> pending_;
  // The save in flight's checkpoint_stats, its seconds to be the stall ("": logged), its step
  // and its seconds in save().
  std::string stall_stats_;
  int64_t stall_step_ = 0;
  double stall_s_ = 0;
};

}  // namespace loom
