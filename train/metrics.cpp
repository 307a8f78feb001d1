#include "train/metrics.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "core/error.hpp"

namespace loom {

namespace {

// Shortest text that reads back to the same double; null for NaN and infinities.
std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string bytes_text(size_t b) {
  char buf[32];
  const double MiB = 1024.0 * 1024.0;
  if (double(b) >= 1024 * MiB)
    std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / (1024 * MiB));
  else
    std::snprintf(buf, sizeof buf, "%.0f MiB", double(b) / MiB);
  return buf;
}

std::string rate_text(double tokens_per_s) {
  char buf[32];
  if (tokens_per_s >= 1e4)
    std::snprintf(buf, sizeof buf, "%.1fk", tokens_per_s / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", tokens_per_s);
  return buf;
}

// Rewrites `path` without the lines of steps after `last` (every line starts {"step": N).
void keep_steps_up_to(const std::string& path, int64_t last) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  bool dropped = false;
  while (std::getline(in, line)) {
    static constexpr std::string_view key = "{\"step\": ";
    int64_t step = -1;
    if (line.compare(0, key.size(), key) == 0)
      std::from_chars(line.data() + key.size(), line.data() + line.size(), step);
    if (step > last) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  if (!dropped) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    LOOM_CHECK(out.good(), "metrics.jsonl: cannot write '", tmp, "'");
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace

std::string step_json(const StepMetrics& m) {
  std::string extra;
  for (const StepMetrics::Extra& e : m.extra)
    extra += str_cat(", \"", e.name, "\": ", num(e.value));
  return str_cat("{\"step\": ", m.step, ", \"loss\": ", num(m.loss), ", \"lr\": ", num(m.lr),
                 ", \"grad_norm\": ", num(m.grad_norm), ", \"tokens_per_s\": ", num(m.tokens_per_s),
                 ", \"mfu\": ", num(m.mfu), ", \"peak_allocated_bytes\": ", m.peak_allocated_bytes,
                 ", \"step_s\": ", num(m.step_seconds), ", \"tokens\": ", m.tokens_seen, extra,
                 "}");
}

std::string validation_json(int64_t step, double val_loss) {
  return str_cat("{\"step\": ", step, ", \"val_loss\": ", num(val_loss), "}");
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = std::llround(s);
  char buf[32];
  if (t < 60)
    std::snprintf(buf, sizeof buf, "%llds", (long long)t);
  else if (t < 3600)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(t / 60), (long long)(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(t / 3600),
                  (long long)(t % 3600 / 60));
  return buf;
}

std::string progress_text(const StepMetrics& m) {
  const int width = int(std::to_string(m.total_steps).size());
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "step %*lld/%lld | loss %.4f | lr %.2e | grad %.3f | %s tok/s | MFU %.1f%% | "
                "mem %s | ETA %s",
                width, (long long)m.step, (long long)m.total_steps, m.loss, m.lr, m.grad_norm,
                rate_text(m.tokens_per_s).c_str(), 100 * m.mfu,
                bytes_text(m.peak_allocated_bytes).c_str(), format_duration(m.eta_seconds).c_str());
  std::string text = buf;
  for (const StepMetrics::Extra& e : m.extra) {
    std::snprintf(buf, sizeof buf, " | %s %.4g", e.label.c_str(), e.value);
    text += buf;
  }
  return text;
}

MetricsLogger::MetricsLogger(const Options& options) : o_(options) {
  if (o_.jsonl.empty()) return;
  const std::filesystem::path p(o_.jsonl);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (o_.resume_step >= 0) keep_steps_up_to(o_.jsonl, o_.resume_step);
  jsonl_ = std::fopen(o_.jsonl.c_str(), o_.resume_step >= 0 ? "a" : "w");
  LOOM_CHECK(jsonl_, "metrics.jsonl: cannot open '", o_.jsonl, "' for writing");
}

MetricsLogger::~MetricsLogger() {
  finish();
  if (jsonl_) std::fclose(jsonl_);
}

void MetricsLogger::clear_line() {
  if (!line_drawn_ || out_lost_) return;
  std::fputs("\r\033[K", o_.out);
  line_drawn_ = false;
}

void MetricsLogger::write_jsonl(const std::string& line) {
  if (!jsonl_) return;
  // A full disk or a lost file system must end the run: metrics silently missing (a 0-byte file
  // after a long run) are found only when they are needed.
  errno = 0;
  const bool ok = std::fprintf(jsonl_, "%s\n", line.c_str()) >= 0 && std::fflush(jsonl_) == 0;
  LOOM_CHECK(ok, "metrics.jsonl: cannot write '", o_.jsonl,
             "': ", errno ? std::strerror(errno) : "write error",
             " (free space there, or set another --metrics.jsonl)");
}

// Unlike the JSONL file, a lost terminal or pipe does not end the run: a stop signal often comes
// with it (Ctrl-C on `loom train | tee log` ends tee too), and the run must still save.
void MetricsLogger::flush_out() {
  errno = 0;
  if (std::fflush(o_.out) == 0 && !std::ferror(o_.out)) return;
  out_lost_ = true;
  const std::string note =
      str_cat("loom train: cannot write progress to ", o_.out == stdout ? "stdout" : "its log",
              " (", errno ? std::strerror(errno) : "write error",
              "); the run goes on without it, metrics.jsonl and rank logs still get every line");
  std::fprintf(stderr, "%s\n", note.c_str());
  if (o_.note_lost_out) std::fprintf(o_.note_lost_out, "%s\n", note.c_str());
}

void MetricsLogger::step(const StepMetrics& m) {
  write_jsonl(step_json(m));
  if (out_lost_) return;
  if (o_.tty) {
    std::fprintf(o_.out, "\r%s\033[K", progress_text(m).c_str());
    line_drawn_ = true;
    flush_out();
  } else if (m.step % o_.log_every == 0 || m.step == m.total_steps) {
    std::fprintf(o_.out, "%s\n", progress_text(m).c_str());
    flush_out();
  }
}

void MetricsLogger::validation(int64_t step, double val_loss) {
  write_jsonl(validation_json(step, val_loss));
  char buf[96];
  std::snprintf(buf, sizeof buf, "step %lld | val_loss %.4f", (long long)step, val_loss);
  message(buf);
}

void MetricsLogger::message(const std::string& line) {
  if (out_lost_) return;
  clear_line();
  std::fprintf(o_.out, "%s\n", line.c_str());
  flush_out();
}

void MetricsLogger::finish() {
  if (!line_drawn_ || out_lost_) return;
  std::fputs("\n", o_.out);
  flush_out();
  line_drawn_ = false;
}

}  // namespace loom
