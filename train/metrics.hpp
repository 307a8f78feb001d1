#pragma once
// What a training run reports: a live progress line on a terminal (redrawn in place with \r), plain
// lines every `log_every` steps otherwise, and, with [metrics] jsonl, one JSON object per step and
// one per validation (docs/design.md's command-line contract: step, loss, lr, grad_norm,
// tokens_per_s, mfu, peak_allocated_bytes; val_loss). The JSONL file is flushed after every line,
// so it can be followed while the run goes and is complete up to the last step if the run dies.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace loom {

struct StepMetrics {
  int64_t step = 0, total_steps = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // achieved model FLOP/s over the measured GEMM peak (0 when not measured)
  double step_seconds = 0;
  double eta_seconds = 0;
  size_t peak_allocated_bytes = 0;
  int64_t tokens_seen = 0;
  // The model's own (a MoE's auxiliary loss, its experts' load): name (JSONL), label (the progress
  // line), value.
  struct Extra {
    std::string name, label;
    double value = 0;
  };
  std::vector<Extra> extra;
};

// One JSON object (no newline). Non-finite numbers are written as null (JSON has no NaN).
std::string step_json(const StepMetrics& m);
std::string validation_json(int64_t step, double val_loss);
// The text of the progress line: step/total, loss, lr, grad norm, tokens/s, MFU, peak memory, ETA.
std::string progress_text(const StepMetrics& m);
std::string format_duration(double seconds);  // "42s", "3m07s", "2h05m"

class MetricsLogger {
 public:
  struct Options {
    FILE* out = stdout;
    bool tty = false;       // redraw one progress line instead of printing lines
    int64_t log_every = 1;  // plain lines: every log_every steps (and the last step)
    std::string jsonl;      // "" = none
    // A resumed run continues an existing JSONL file: lines of steps after `resume_step` (logged
    // by the interrupted run after its last checkpoint, and about to be redone) are dropped.
    // -1: a fresh file.
    int64_t resume_step = -1;
    // A failed write to `out` (a closed pipe: `loom train | head`, a `| tee` that Ctrl-C ended)
    // is noted once on stderr and in this file (a rank log; nullptr: none), and `out` is then left
    // alone: the run goes on, its lines still go to the JSONL file and the rank log.
    FILE* note_lost_out = nullptr;
  };
  explicit MetricsLogger(const Options& options);
  ~MetricsLogger();
  MetricsLogger(const MetricsLogger&) = delete;
  MetricsLogger& operator=(const MetricsLogger&) = delete;

  // Both throw loom::Error, naming the file, when the JSONL line cannot be written.
  void step(const StepMetrics& m);
  void validation(int64_t step, double val_loss);
  // A line of its own (the progress line, if drawn, is cleared first and redrawn by the next step).
  void message(const std::string& line);
  void finish();  // ends a drawn progress line with a newline

 private:
  void clear_line();
  void write_jsonl(const std::string& line);
  void flush_out();
  Options o_;
  FILE* jsonl_ = nullptr;
  bool line_drawn_ = false;
  bool out_lost_ = false;
};

}  // namespace loom
