#include "train/tensorboard_writer.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.hpp"
#include "train/tensorboard_event.pb.h"
#include "train/tfrecord.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;
namespace pb = loom::tensorboard;

// TensorBoard reads a file whose first event says version 2 with SessionLog semantics (a START
// purges what follows it), not by guessing restarts from steps that go back.
constexpr const char* kFileVersion = "brain.Event:2";
constexpr const char* kNamePrefix = "events.out.tfevents.";

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in, "metrics.tensorboard: cannot read the event file '", path, "'");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

pb::Event event_at(int64_t step) {
  pb::Event e;
  e.set_wall_time(wall_time());
  e.set_step(step);
  return e;
}

void add_scalar(pb::Summary* s, const char* tag, double v) {
  pb::Summary::Value* value = s->add_value();
  value->set_tag(tag);
  value->set_simple_value(float(v));
}

// The text plugin renders Markdown: the TOML in a fenced block keeps its lines and shows as code.
pb::Event config_event(int64_t step, const std::string& toml) {
  pb::Event e = event_at(step);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag("config");
  // Empty content is the text plugin's TextPluginData of version 0.
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  pb::TensorProto* t = v->mutable_tensor();
  t->set_dtype(pb::DT_STRING);
  t->mutable_tensor_shape();  // no dimensions: a scalar string
  t->add_string_val(str_cat("```toml\n", toml, toml.ends_with('\n') ? "" : "\n", "```"));
  return e;
}

// Keeps the events of steps <= `last` in `path` (and any record that is not an event), without a
// torn last record; the file is rewritten (a temporary file renamed over it) only when something
// goes.
void keep_steps_up_to(const std::string& path, int64_t last) {
  const std::string bytes = read_file(path);
  const TFRecords r = parse_tfrecords(bytes);
  bool changed = !r.complete();
  std::string kept;
  for (const std::string& record : r.records) {
    pb::Event e;
    if (e.ParseFromString(record) && e.step() > last && !e.has_file_version()) {
      changed = true;
      continue;
    }
    kept += tfrecord_frame(record);
  }
  if (!changed) return;
  // Not named *tfevents*: TensorBoard must never take a leftover for an event file.
  const std::string tmp = (fs::path(path).parent_path() / ".loom-tensorboard-rewrite.tmp").string();
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(kept.data(), std::streamsize(kept.size()));
    out.flush();
    LOOM_CHECK(out.good(), "metrics.tensorboard: cannot write '", tmp,
               "' (rewriting the event file '", path, "' without the steps after ", last, ")");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  LOOM_CHECK(!ec, "metrics.tensorboard: cannot replace the event file '", path,
             "': ", ec.message());
}

std::string host_name() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') return "localhost";
  return host;
}

// TensorBoard's own naming (events.out.tfevents.<seconds>.<host>.<pid>.<n>), with the seconds
// raised where needed so that the name sorts after every file already in the directory: a run's
// files are read in name order, and a resume's must come after the run it continues.
std::string new_file_name(const std::vector<std::string>& existing) {
  int64_t seconds = int64_t(std::time(nullptr));
  auto name = [&] {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%010lld.", kNamePrefix, (long long)seconds);
    return str_cat(buf, host_name(), ".", getpid(), ".0");
  };
  if (existing.empty()) return name();
  const std::string last = fs::path(existing.back()).filename().string();
  if (name() > last) return name();
  int64_t last_seconds = 0;
  const std::string_view digits = std::string_view(last).substr(std::strlen(kNamePrefix));
  if (last.rfind(kNamePrefix, 0) == 0 &&
      std::from_chars(digits.data(), digits.data() + digits.size(), last_seconds).ec == std::errc())
    seconds = std::max(seconds, last_seconds + 1);
  return name();
}

}  // namespace

std::vector<std::string> tensorboard_event_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec) &&
        it->path().filename().string().find("tfevents") != std::string::npos)
      out.push_back(it->path().string());
  std::sort(out.begin(), out.end());
  return out;
}

TensorBoardHistory tensorboard_history(const std::vector<std::string>& files) {
  TensorBoardHistory h;
  for (const std::string& f : files) {
    for (const std::string& record : parse_tfrecords(read_file(f)).records) {
      pb::Event e;
      // Only scalars are history: the version and the config text alone are a run that ended
      // before its first step.
      if (!e.ParseFromString(record)) continue;
      bool scalar = false;
      for (const auto& v : e.summary().value()) scalar = scalar || v.has_simple_value();
      if (!scalar) continue;
      ++h.events;
      h.last_step = std::max(h.last_step, e.step());
    }
  }
  return h;
}

TensorBoardWriter::TensorBoardWriter(const Options& o) {
  std::error_code ec;
  fs::create_directories(o.dir, ec);
  LOOM_CHECK(fs::is_directory(o.dir), "metrics.tensorboard '", o.dir, "' cannot be created",
             ec ? ": " + ec.message() : std::string(),
             " (expected a directory for TensorBoard's event files, or \"\" for none)");
  std::vector<std::string> existing = tensorboard_event_files(o.dir);
  if (o.resume_step < 0) {
    for (const std::string& f : existing) {
      fs::remove(f, ec);
      LOOM_CHECK(!ec, "metrics.tensorboard: cannot remove the earlier run's event file '", f,
                 "': ", ec.message());
    }
    existing.clear();
  } else {
    for (const std::string& f : existing) keep_steps_up_to(f, o.resume_step);
  }
  path_ = (fs::path(o.dir) / new_file_name(existing)).string();
  // "x": never another file of that name, even if a clock went back.
  file_.reset(std::fopen(path_.c_str(), "wbx"));
  LOOM_CHECK(file_ != nullptr, "metrics.tensorboard: cannot create the event file '", path_,
             "': ", std::strerror(errno));
  pb::Event version = event_at(0);
  version.set_file_version(kFileVersion);
  write(version.SerializeAsString());
  const int64_t first = o.resume_step < 0 ? 0 : o.resume_step + 1;
  if (o.resume_step >= 0) {
    pb::Event start = event_at(first);
    start.mutable_session_log()->set_status(pb::SessionLog::START);
    write(start.SerializeAsString());
  }
  if (!o.config_toml.empty()) write(config_event(first, o.config_toml).SerializeAsString());
}

void TensorBoardWriter::write(const std::string& event) {
  const std::string record = tfrecord_frame(event);
  // A full disk must end the run, as for metrics.jsonl: a silently missing curve is found only
  // when it is needed.
  errno = 0;
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_.get()) == record.size() &&
                  std::fflush(file_.get()) == 0;
  LOOM_CHECK(ok, "metrics.tensorboard: cannot write '", path_,
             "': ", errno ? std::strerror(errno) : "write error",
             " (free space there, or set another --metrics.tensorboard, \"\" for none)");
}

void TensorBoardWriter::step(const StepMetrics& m) {
  pb::Event e = event_at(m.step);
  pb::Summary* s = e.mutable_summary();
  add_scalar(s, "loss", m.loss);
  add_scalar(s, "lr", m.lr);
  add_scalar(s, "grad_norm", m.grad_norm);
  add_scalar(s, "tokens_per_s", m.tokens_per_s);
  add_scalar(s, "mfu", m.mfu);
  add_scalar(s, "peak_allocated_bytes", double(m.peak_allocated_bytes));
  // The model's own (a mixture of experts' auxiliary loss, expert load, dropped share).
  for (const StepMetrics::Extra& x : m.extra) add_scalar(s, x.name.c_str(), x.value);
  write(e.SerializeAsString());
}

void TensorBoardWriter::validation(int64_t step, double val_loss) {
  pb::Event e = event_at(step);
  add_scalar(e.mutable_summary(), "val_loss", val_loss);
  write(e.SerializeAsString());
}

}  // namespace loom
