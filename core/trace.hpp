#pragma once
// Chrome trace events (the JSON that chrome://tracing and Perfetto open): spans of wall time, each
// with the thread's CPU time (CLOCK_THREAD_CPUTIME_ID) over the same interval in its args, since
// on shared cores a span's wall time measures the other processes as much as the work. One
// Recorder per process, installed by the trainer ([profiling] trace); with none installed a Span
// records nothing and costs one pointer test.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom::trace {

struct Event {
  std::string name, cat;
  double ts_us = 0, dur_us = 0, cpu_us = 0;  // start (since the recorder's creation), lengths
  // Extra args: key and JSON text of the value (a number, or a quoted string).
  std::vector<std::pair<std::string, std::string>> args;
};

class Recorder {
 public:
  // pid: the process id shown in the viewer (the world rank).
  explicit Recorder(int pid);
  double now_us() const;  // wall time since creation
  void add(Event e) { events_.push_back(std::move(e)); }
  const std::vector<Event>& events() const { return events_; }
  // {"traceEvents": [...], "displayTimeUnit": "ms"}: complete ("X") events, in recording order.
  std::string json() const;
  // Writes json() to path (through a temporary file and a rename, so a reader never sees half).
  void write(const std::string& path) const;

 private:
  int pid_;
  int64_t start_ns_;
  std::vector<Event> events_;
};

// The installed recorder (nullptr: tracing off). Not owned.
void set_recorder(Recorder* r);
Recorder* recorder();

double thread_cpu_us();

// A span from construction to destruction (or end()), added to the installed recorder.
class Span {
 public:
  Span(const char* cat, std::string name);
  ~Span() { end(); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  Span& arg(const char* key, int64_t v);
  Span& arg(const char* key, const std::string& v);
  void end();

 private:
  Recorder* rec_;
  Event e_;
  double cpu0_ = 0;
};

}  // namespace loom::trace
