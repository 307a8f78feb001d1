#include "core/trace.hpp"

#include <time.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

namespace loom::trace {
namespace {

Recorder* g_recorder = nullptr;

int64_t clock_ns(clockid_t id) {
  timespec t{};
  clock_gettime(id, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) >= 0x20) out += ch;
  }
  return out + "\"";
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

}  // namespace

Recorder::Recorder(int pid) : pid_(pid), start_ns_(clock_ns(CLOCK_MONOTONIC)) {}

double Recorder::now_us() const {
  return double(clock_ns(CLOCK_MONOTONIC) - start_ns_) / 1e3;
}

std::string Recorder::json() const {
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  out += str_cat("{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": ", pid_,
                 ", \"tid\": 0, \"args\": {\"name\": \"rank ", pid_, "\"}}");
  for (const Event& e : events_) {
    out += str_cat(",\n{\"name\": ", quoted(e.name), ", \"cat\": ", quoted(e.cat),
                   ", \"ph\": \"X\", \"pid\": ", pid_, ", \"tid\": 0, \"ts\": ", number(e.ts_us),
                   ", \"dur\": ", number(e.dur_us), ", \"args\": {\"cpu_us\": ", number(e.cpu_us));
    for (const auto& [k, v] : e.args) out += str_cat(", ", quoted(k), ": ", v);
    out += "}}";
  }
  return out + "\n]}\n";
}

void Recorder::write(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << json();
    LOOM_CHECK(f.good(), "profiling.trace: cannot write '", tmp, "'");
  }
  std::filesystem::rename(tmp, path);
}

void set_recorder(Recorder* r) {
  g_recorder = r;
}
Recorder* recorder() {
  return g_recorder;
}

double thread_cpu_us() {
  return double(clock_ns(CLOCK_THREAD_CPUTIME_ID)) / 1e3;
}

Span::Span(const char* cat, std::string name) : rec_(g_recorder) {
  if (!rec_) return;
  e_.cat = cat;
  e_.name = std::move(name);
  e_.ts_us = rec_->now_us();
  cpu0_ = thread_cpu_us();
}

Span& Span::arg(const char* key, int64_t v) {
  if (rec_) e_.args.emplace_back(key, std::to_string(v));
  return *this;
}

Span& Span::arg(const char* key, const std::string& v) {
  if (rec_) e_.args.emplace_back(key, quoted(v));
  return *this;
}

void Span::end() {
  if (!rec_) return;
  e_.dur_us = rec_->now_us() - e_.ts_us;
  e_.cpu_us = thread_cpu_us() - cpu0_;
  rec_->add(std::move(e_));
  rec_ = nullptr;
}

}  // namespace loom::trace
