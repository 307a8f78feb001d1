#pragma once
// A progress line for a long phase of a command: bytes done of a known total, documents, tokens/s
// (MB/s while there are no tokens) and the time left. A thread of its own prints it, so workers
// only bump atomic counters and never wait on the terminal. On a terminal the line is redrawn in
// place (\r) twice a second; otherwise (a log file, a pipe) a plain line is printed every 10 s,
// which keeps a log short and still shows a long run is alive.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace loom {

class ProgressLine {
 public:
  ProgressLine(std::string label, uint64_t total_bytes, bool tty);
  ~ProgressLine();  // stop()
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Bytes of the total done so far; a smaller value than the last one is ignored, so workers that
  // finish out of order can each report where they are.
  void bytes_done(uint64_t bytes);
  // Or more bytes done, for workers that each read a part of the total.
  void add_bytes(uint64_t bytes) { bytes_.fetch_add(bytes, std::memory_order_relaxed); }
  void add(int64_t documents, uint64_t tokens) {
    documents_.fetch_add(documents, std::memory_order_relaxed);
    tokens_.fetch_add(tokens, std::memory_order_relaxed);
  }
  // Ends the thread; on a terminal where the line was drawn, draws the final state and ends it.
  void stop();

 private:
  void run();
  std::string text() const;

  const std::string label_;
  const uint64_t total_;
  const bool tty_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes_{0}, tokens_{0};
  std::atomic<int64_t> documents_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  size_t drawn_ = 0;  // length of the line on the terminal, to blank what a shorter one leaves
  std::thread thread_;
};

}  // namespace loom
