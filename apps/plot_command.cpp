// `loom plot`: the figures of metrics JSONL files (the [metrics] jsonl of `loom train`) against
// step, one colour per run, a panel per metric: loss (train and validation), throughput, MFU and
// peak memory; drawn as PNG, SVG or PDF by apps/plot_render.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/plot_render.hpp"
#include "core/error.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

const char* kPlotUsage =
    "usage: loom plot METRICS.jsonl [MORE.jsonl ...] --output FILE.(png|svg|pdf) [--title T]\n"
    "                 [--panels loss,throughput,mfu,memory,aux,load,dropped] [--log-y]\n"
    "  draws each metric against \"step\", one colour per file, a panel per metric that a file "
    "has:\n"
    "    loss        \"loss\" (line) and \"val_loss\" (dashed, with markers)\n"
    "    throughput  \"tokens_per_s\"\n"
    "    mfu         \"mfu\", in % (0, not measured, is left out)\n"
    "    memory      \"peak_allocated_bytes\", in MiB (GiB from 16 GiB)\n"
    "    aux         \"aux_loss\": a mixture of experts' auxiliary load-balancing loss\n"
    "    load        \"expert_load\": the most tokens an expert got over the mean, worst layer\n"
    "    dropped     \"dropped\": the share of routed tokens over an expert's capacity (asked "
    "only)\n"
    "  --panels picks and orders the panels; --log-y puts the loss on a log axis\n";

// The panels, in their default order, and the metrics.jsonl key each draws.
enum Metric : size_t { kLoss, kThroughput, kMfu, kMemory, kAux, kLoad, kDropped, kNumMetrics };
struct MetricInfo {
  const char* panel;  // the name --panels takes
  const char* key;
  const char* title;
  const char* y_label;
};
constexpr MetricInfo kMetrics[kNumMetrics] = {
    {"loss", "loss", "loss", "loss"},
    {"throughput", "tokens_per_s", "throughput", "tokens/s"},
    {"mfu", "mfu", "model FLOPs utilization", "MFU (%)"},
    {"memory", "peak_allocated_bytes", "peak memory", ""},  // the unit is chosen from the data
    // A mixture of experts' (model/moe.hpp take_step_metrics).
    {"aux", "aux_loss", "auxiliary loss", "load-balancing loss"},
    {"load", "expert_load", "expert load", "max / mean tokens"},
    {"dropped", "dropped", "dropped tokens", "share"},
};

struct RunMetrics {
  std::vector<plot::Point> series[kNumMetrics];
  std::vector<plot::Point> val_loss;
};

// A number, or NaN for null: train/metrics.cpp writes a non-finite value (a diverged loss) as
// null, and the renderer breaks the line there rather than joining across it.
bool number_at(const nlohmann::json& j, const char* key, double& out) {
  auto it = j.find(key);
  if (it == j.end() || !(it->is_number() || it->is_null())) return false;
  out = it->is_null() ? std::nan("") : it->get<double>();
  return true;
}

RunMetrics read_metrics(const std::string& path) {
  std::ifstream in(path);
  LOOM_CHECK(fs::is_regular_file(path) && in.good(), "metrics file ", path, " does not exist");
  RunMetrics r;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(path, ":", lineno, ": not a JSON object (", e.what(), ")");
    }
    LOOM_CHECK(j.is_object(), path, ":", lineno, ": expected a JSON object, got ", j.type_name());
    double step, v;
    if (!number_at(j, "step", step) || !std::isfinite(step)) continue;
    for (size_t m = 0; m < kNumMetrics; ++m)
      // train/metrics.cpp writes an MFU of 0 when the GEMM peak was not measured.
      if (number_at(j, kMetrics[m].key, v) && !(m == kMfu && v == 0))
        r.series[m].push_back({step, m == kMfu ? 100 * v : v});
    if (number_at(j, "val_loss", v)) r.val_loss.push_back({step, v});
  }
  bool any = !r.val_loss.empty();
  for (const auto& s : r.series) any = any || !s.empty();
  LOOM_CHECK(any, path,
             ": no rows with \"step\" and \"loss\" (or \"val_loss\", \"tokens_per_s\", \"mfu\", "
             "\"peak_allocated_bytes\", \"aux_loss\", \"expert_load\", \"dropped\")");
  auto by_step = [](const plot::Point& a, const plot::Point& b) { return a.x < b.x; };
  for (auto& s : r.series) std::stable_sort(s.begin(), s.end(), by_step);
  std::stable_sort(r.val_loss.begin(), r.val_loss.end(), by_step);
  return r;
}

std::vector<Metric> parse_panels(const std::string& list) {
  std::vector<Metric> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    const auto* it = std::find_if(std::begin(kMetrics), std::end(kMetrics),
                                  [&](const MetricInfo& m) { return name == m.panel; });
    LOOM_CHECK(it != std::end(kMetrics), "--panels: unknown panel '", name,
               "' (loss, throughput, mfu or memory)");
    const Metric m = Metric(it - std::begin(kMetrics));
    LOOM_CHECK(std::find(out.begin(), out.end(), m) == out.end(), "--panels: '", name, "' twice");
    out.push_back(m);
    start = comma + 1;
  }
  return out;
}

bool has_finite(const std::vector<plot::Point>& pts) {
  return std::any_of(pts.begin(), pts.end(),
                     [](const plot::Point& p) { return std::isfinite(p.y); });
}

// One panel of every run's `metric` (and the loss's validation curves), none if no run has it.
plot::Panel make_panel(Metric metric, const std::vector<RunMetrics>& runs, bool log_y) {
  const MetricInfo& info = kMetrics[metric];
  plot::Panel p{info.title, info.y_label, metric == kLoss && log_y, {}};
  double scale = 1;
  if (metric == kMemory) {
    double peak = 0;
    for (const auto& r : runs)
      for (const auto& pt : r.series[kMemory]) peak = std::max(peak, pt.y);
    const bool gib = peak >= 16.0 * (1 << 30);
    scale = 1.0 / (gib ? 1 << 30 : 1 << 20);
    p.y_label = gib ? "peak allocated (GiB)" : "peak allocated (MiB)";
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    if (has_finite(runs[i].series[metric])) {
      plot::Curve c{i, false, runs[i].series[metric]};
      for (auto& pt : c.points) pt.y *= scale;
      p.curves.push_back(std::move(c));
    }
    if (metric == kLoss && has_finite(runs[i].val_loss))
      p.curves.push_back({i, true, runs[i].val_loss});
  }
  return p;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  LOOM_CHECK(out.good(), "cannot write ", path, ": ", std::strerror(errno));
  out.write(bytes.data(), std::streamsize(bytes.size()));
  out.close();
  LOOM_CHECK(out.good(), "writing ", path, " failed: ", std::strerror(errno));
}

}  // namespace

int plot_command(const Args& args) {
  std::vector<std::string> inputs;
  std::string output, title, panels;
  bool log_y = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    std::string* value = a == "--output" || a == "-o" ? &output
                         : a == "--title"             ? &title
                         : a == "--panels"            ? &panels
                                                      : nullptr;
    if (value) {
      LOOM_CHECK(i + 1 < args.size(), a, " needs a value\n", kPlotUsage);
      *value = args[++i];
    } else if (a.rfind("--output=", 0) == 0) {
      output = a.substr(9);
    } else if (a.rfind("--title=", 0) == 0) {
      title = a.substr(8);
    } else if (a.rfind("--panels=", 0) == 0) {
      panels = a.substr(9);
    } else if (a == "--log-y") {
      log_y = true;
    } else if (a == "--help" || a == "-h") {
      std::fputs(kPlotUsage, stdout);
      return 0;
    } else {
      LOOM_CHECK(a.rfind("--", 0) != 0, "unknown option '", a, "'\n", kPlotUsage);
      inputs.push_back(a);
    }
  }
  LOOM_CHECK(!inputs.empty(), "plot needs at least one metrics file\n", kPlotUsage);
  LOOM_CHECK(!output.empty(), "plot needs --output FILE.png, FILE.svg or FILE.pdf\n", kPlotUsage);
  plot::Format format;
  try {
    format = plot::format_of(output);
  } catch (const std::invalid_argument& e) {
    fail("--output ", e.what());
  }
  const bool chosen = !panels.empty();
  const std::vector<Metric> metrics =
      chosen ? parse_panels(panels)
             : std::vector<Metric>{kLoss, kThroughput, kMfu, kMemory, kAux, kLoad};

  plot::Figure fig;
  fig.title = title;
  // Legend entries are the file names, or the paths as given when two files share a name
  // (run-a/metrics.jsonl and run-b/metrics.jsonl).
  std::map<std::string, int> seen;
  for (const auto& p : inputs) ++seen[fs::path(p).filename().string()];
  std::vector<RunMetrics> runs;
  for (const auto& p : inputs) {
    runs.push_back(read_metrics(p));
    const std::string base = fs::path(p).filename().string();
    fig.runs.push_back(seen[base] > 1 ? p : base);
    if (log_y)
      for (const auto* pts : {&runs.back().series[kLoss], &runs.back().val_loss})
        for (const auto& pt : *pts)
          LOOM_CHECK(!(pt.y <= 0), p, ": --log-y needs losses > 0, found ", pt.y, " at step ",
                     pt.x);
  }
  size_t points = 0;
  for (Metric m : metrics) {
    plot::Panel panel = make_panel(m, runs, log_y);
    // A metric that no input has: no panel, unless --panels asked for it.
    LOOM_CHECK(!chosen || !panel.curves.empty(), "--panels: no input has \"", kMetrics[m].key, "\"",
               m == kMfu ? " (other than 0, not measured)" : "", " for the ", kMetrics[m].panel,
               " panel");
    for (const auto& c : panel.curves) points += c.points.size();
    if (!panel.curves.empty()) fig.panels.push_back(std::move(panel));
  }
  LOOM_CHECK(!fig.panels.empty(), "plot: none of the inputs has a metric to draw");

  std::string bytes;
  try {
    bytes = plot::render(fig, format);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  write_file(output, bytes);
  std::fprintf(stderr, "loom plot: %zu run(s), %zu panel(s), %zu points -> %s\n", fig.runs.size(),
               fig.panels.size(), points, output.c_str());
  return 0;
}

}  // namespace loom
