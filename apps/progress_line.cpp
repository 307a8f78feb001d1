#include "apps/progress_line.hpp"

#include <algorithm>
#include <cstdio>

namespace loom {

namespace {

std::string duration_text(double s) {
  const long t = long(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

std::string rate_text(double per_s, const char* unit) {
  char buf[48];
  if (per_s >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM %s/s", per_s / 1e6, unit);
  else if (per_s >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk %s/s", per_s / 1e3, unit);
  else
    std::snprintf(buf, sizeof buf, "%.0f %s/s", per_s, unit);
  return buf;
}

}  // namespace

ProgressLine::ProgressLine(std::string label, uint64_t total_bytes, bool tty)
    : label_(std::move(label)), total_(total_bytes), tty_(tty), thread_([this] { run(); }) {}

ProgressLine::~ProgressLine() {
  stop();
}

void ProgressLine::bytes_done(uint64_t bytes) {
  uint64_t cur = bytes_.load(std::memory_order_relaxed);
  while (bytes > cur && !bytes_.compare_exchange_weak(cur, bytes, std::memory_order_relaxed)) {
  }
}

std::string ProgressLine::text() const {
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const uint64_t bytes = std::min(bytes_.load(std::memory_order_relaxed), total_);
  const uint64_t tokens = tokens_.load(std::memory_order_relaxed);
  const double frac = total_ ? double(bytes) / double(total_) : 1.0;
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s: %.1f/%.1f MB (%.0f%%), %lld documents", label_.c_str(),
                double(bytes) / 1e6, double(total_) / 1e6, 100.0 * frac,
                (long long)documents_.load(std::memory_order_relaxed));
  std::string line = buf;
  const double rs = std::max(s, 1e-9);
  line += ", " + (tokens ? rate_text(double(tokens) / rs, "tokens")
                         : rate_text(double(bytes) / 1e6 / rs, "MB"));
  // The time left at the rate so far; nothing until there is a rate to go by.
  if (bytes > 0 && bytes < total_) line += ", ETA " + duration_text(s * (1.0 - frac) / frac);
  line += ", " + duration_text(s) + " so far";
  return line;
}

void ProgressLine::run() {
  const auto period = tty_ ? std::chrono::milliseconds(500) : std::chrono::milliseconds(10000);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period, [this] { return stopping_; })) {
    const std::string line = text();
    if (tty_) {
      // Spaces over whatever a longer earlier line left behind.
      std::printf("\r%s%*s", line.c_str(), int(drawn_ > line.size() ? drawn_ - line.size() : 0),
                  "");
      drawn_ = line.size();
    } else {
      std::printf("  %s\n", line.c_str());
    }
    std::fflush(stdout);
  }
}

void ProgressLine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // The last state, where the line has been drawn: a phase too short to be drawn leaves nothing.
  if (tty_ && drawn_ > 0) {
    const std::string line = text();
    std::printf("\r%s%*s\n", line.c_str(), int(drawn_ > line.size() ? drawn_ - line.size() : 0),
                "");
    std::fflush(stdout);
  }
}

}  // namespace loom
