#include "train/checkpoint_saver.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "core/allocator.hpp"
#include "core/error.hpp"
#include "model/model.hpp"
#include "train/optimizer.hpp"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A save or a load may allocate, beyond the rank's shards (and, for an async save, its staging
// copy of them), only the small tensors of its agreements (written keys, error texts): nothing
// the size of a tensor of the model. bench/ckpt_bench.sh fails a rank that goes over.
constexpr size_t kCheckpointSlackBytes = size_t(64) << 10;

}  // namespace

size_t checkpoint_shard_bytes(Model& model, AdamW& optimizer) {
  size_t n = 0;
  auto units = model.units();
  for (size_t i = 0; i < units.size(); ++i)
    if (model.uses(i))  // a pp rank's units of other stages hold nothing
      n += units[i]->master_shard().nbytes() + optimizer.exp_avg()[i].nbytes() +
           optimizer.exp_avg_sq()[i].nbytes();
  return n;
}

std::string checkpoint_stats(const char* what, int rank, double seconds, size_t held, size_t shards,
                             size_t peak, size_t staging) {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "checkpoint stats: %s rank=%d seconds=%.3f held_bytes=%zu shard_bytes=%zu "
                "extra_peak_bytes=%zu bound_extra_bytes=%zu",
                what, rank, seconds, held, shards, peak > held ? peak - held : 0,
                staging + kCheckpointSlackBytes);
  return buf;
}

CheckpointSaver::CheckpointSaver(Options options, Model& model, AdamW& optimizer, Allocator& alloc,
                                 std::function<void(const std::string&)> log)
    : o_(std::move(options)),
      model_(model),
      optimizer_(optimizer),
      alloc_(alloc),
      log_(std::move(log)),
      run_peak_(o_.run_peak) {
  // The staging buffer (the rank's shards: f32 weights + 2 moments), its pages touched by a
  // thread while the first steps run: faulting in 0.9 GB of fresh pages made the first save's
  // stall 11 s against 0.5 s for the next one (bench/ckpt_bench.sh). Only before_modify writes
  // into it: it waits for the thread first.
  if (o_.async && !o_.dir.empty()) {
    // What the allocator books for it (its block, rounded up), as it reports it: no thread
    // allocates beside this one yet.
    Allocator& host = Allocator::get(Device::cpu);
    const size_t before = host.stats().allocated;
    staging_ = Tensor::empty({int64_t(checkpoint_shard_bytes(model_, optimizer_) / 4)}, DType::f32);
    staging_bytes_ = host.stats().allocated - before;
    prefault_ = std::jthread(
        [p = staging_.data<float>(), n = staging_.numel()] { std::fill_n(p, n, 0.0f); });
  }
}

CheckpointSaver::~CheckpointSaver() = default;

size_t CheckpointSaver::peak_allocated() const {
  return std::max(run_peak_, alloc_.stats().peak_allocated);
}

// A full disk: say how much room the directory needs, since the oldest checkpoint goes only after
// the new one is complete.
void CheckpointSaver::explain_save_error(const Error& e) const {
  const std::string what = e.what();
  if (what.find(std::strerror(ENOSPC)) == std::string::npos) throw e;
  if (o_.keep > 0)
    fail(what, "\ncheckpoint.dir '", o_.dir,
         "' must have room for checkpoint.keep + 1 = ", o_.keep + 1, " checkpoints of about ",
         o_.each_size,
         " each (a new checkpoint is complete before the oldest is deleted); free space, "
         "lower checkpoint.keep or use another checkpoint.dir");
  fail(what, "\ncheckpoint.dir '", o_.dir,
       "' must have room for every checkpoint (checkpoint.keep = 0 keeps all), about ",
       o_.each_size, " each; free space, set checkpoint.keep or use another checkpoint.dir");
}

// The stats line of the save in flight, its seconds the stall: the training thread's time in
// save() plus in before_update() (`copy_s`, when the optimizer `updated` the shards after it).
void CheckpointSaver::log_stall(bool updated, double copy_s, size_t copied) {
  if (stall_stats_.empty()) return;
  const std::string line = str_cat("step ", stall_step_, " | ", stall_stats_);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%.3f", stall_s_ + copy_s);
  // checkpoint_stats' fields, the seconds put in.
  const size_t at = line.find("seconds=") + 8;
  log_(line.substr(0, at) + buf + line.substr(line.find(' ', at)));
  if (updated)
    std::snprintf(buf, sizeof buf,
                  "%.2f s stall: %.2f s to start the save, %.2f s to copy %.1f MiB it had not "
                  "written before the update",
                  stall_s_ + copy_s, stall_s_, copy_s, double(copied) / double(1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%.2f s stall: %.2f s to start the save, no update after it",
                  stall_s_, stall_s_);
  log_(str_cat("step ", stall_step_, " | ", buf));
  stall_stats_.clear();
}

void CheckpointSaver::before_update() {
  if (!pending_ || stall_stats_.empty()) return;
  const auto t0 = Clock::now();
  if (prefault_.joinable()) prefault_.join();
  const size_t copied = pending_->before_modify();
  log_stall(true, seconds_since(t0), copied);
}

void CheckpointSaver::finish() {
  if (!pending_) return;
  log_stall(false, 0, 0);  // nothing changed the shards: the writer had them to itself
  const auto t0 = Clock::now();
  try {
    last_checkpoint_ = pending_->wait();
  } catch (const Error& e) {
    pending_.reset();
    explain_save_error(e);
  }
  pending_.reset();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", seconds_since(t0));
  log_(str_cat("saved ", last_checkpoint_, " (waited ", buf, " s for it)"));
}

void CheckpointSaver::save(const TrainState& state) {
  const int64_t step = state.step;
  if (o_.dir.empty() || last_saved_ == step) return;
  finish();
  run_peak_ = peak_allocated();
  const size_t held = alloc_.stats().allocated;
  alloc_.reset_peak();
  const auto t0 = Clock::now();
  try {
    if (o_.async) {
      pending_ = save_checkpoint_async(
          o_.dir, model_, optimizer_, state, o_.tokenizer_json, o_.comm,
          [dir = o_.dir, keep = o_.keep, prune = o_.prunes] {
            if (prune) prune_checkpoints(dir, keep);
          },
          staging_);
    } else {
      last_checkpoint_ =
          save_checkpoint(o_.dir, model_, optimizer_, state, o_.tokenizer_json, o_.comm);
    }
  } catch (const Error& e) {
    explain_save_error(e);
  }
  if (!o_.async && o_.prunes) prune_checkpoints(o_.dir, o_.keep);
  last_saved_ = step;
  const double seconds = seconds_since(t0);
  const size_t shards = checkpoint_shard_bytes(model_, optimizer_);
  // The async save's staging copy holds at most the rank's shards: the saver's buffer (held
  // already), as the allocator booked it.
  const std::string stats =
      checkpoint_stats(pending_ ? "save_async" : "save", o_.rank, seconds, held, shards,
                       alloc_.stats().peak_allocated, pending_ ? staging_bytes_ : 0);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", seconds);
  if (pending_) {
    stall_stats_ = stats;
    stall_step_ = step;
    stall_s_ = seconds;
    log_(str_cat("step ", step, " | saving ", pending_->path(), " in the background (", buf,
                 " s to start it)"));
  } else {
    log_(str_cat("step ", step, " | ", stats));
    log_(str_cat("step ", step, " | saved ", last_checkpoint_, " (", buf, " s)"));
  }
}

}  // namespace loom
