// `loom plot`: loss against step from metrics JSONL files (the [metrics] jsonl of `loom train`),
// one colour per run; written as SVG or PNG by apps/plot_render.
#include <algorithm>
#include <cstdio>
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
    "usage: loom plot METRICS.jsonl [MORE.jsonl ...] --output FILE.(svg|png) [--title T] "
    "[--log-y]\n"
    "  draws \"loss\" (line) and \"val_loss\" (markers, dashed) against \"step\", one colour per "
    "file\n";

bool number_at(const nlohmann::json& j, const char* key, double& out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return false;
  out = it->get<double>();
  return true;
}

plot::Series read_metrics(const std::string& path) {
  std::ifstream in(path);
  LOOM_CHECK(fs::is_regular_file(path) && in.good(), "metrics file ", path, " does not exist");
  plot::Series s;
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
    if (!number_at(j, "step", step)) continue;
    if (number_at(j, "loss", v)) s.train.push_back({step, v});
    if (number_at(j, "val_loss", v)) s.val.push_back({step, v});
  }
  LOOM_CHECK(!s.train.empty() || !s.val.empty(), path,
             ": no rows with \"step\" and \"loss\" (or \"val_loss\")");
  auto by_step = [](const plot::Point& a, const plot::Point& b) { return a.x < b.x; };
  std::stable_sort(s.train.begin(), s.train.end(), by_step);
  std::stable_sort(s.val.begin(), s.val.end(), by_step);
  return s;
}

}  // namespace

int plot_command(const Args& args) {
  std::vector<std::string> inputs;
  std::string output, title = "Loss";
  bool log_y = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--output" || a == "-o" || a == "--title") {
      LOOM_CHECK(i + 1 < args.size(), a, " needs a value\n", kPlotUsage);
      (a == "--title" ? title : output) = args[++i];
    } else if (a.rfind("--output=", 0) == 0) {
      output = a.substr(9);
    } else if (a.rfind("--title=", 0) == 0) {
      title = a.substr(8);
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
  LOOM_CHECK(!output.empty(), "plot needs --output FILE.svg or FILE.png\n", kPlotUsage);
  std::string ext = fs::path(output).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  LOOM_CHECK(ext == ".svg" || ext == ".png", "--output ", output,
             ": expected a file name ending in .svg or .png");

  plot::Figure fig;
  fig.title = title;
  fig.log_y = log_y;
  // Legend entries are the file names, or the paths as given when two files share a name
  // (run-a/metrics.jsonl and run-b/metrics.jsonl).
  std::map<std::string, int> seen;
  for (const auto& p : inputs) ++seen[fs::path(p).filename().string()];
  for (const auto& p : inputs) {
    plot::Series s = read_metrics(p);
    const std::string base = fs::path(p).filename().string();
    s.name = seen[base] > 1 ? p : base;
    if (log_y)
      for (const auto* pts : {&s.train, &s.val})
        for (const auto& pt : *pts)
          LOOM_CHECK(pt.y > 0, p, ": --log-y needs losses > 0, found ", pt.y, " at step ", pt.x);
    fig.series.push_back(std::move(s));
  }

  std::string bytes;
  try {
    if (ext == ".svg") {
      bytes = plot::render_svg(fig);
    } else {
      const std::vector<uint8_t> png = plot::render_png(fig);
      bytes.assign(png.begin(), png.end());
    }
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  std::ofstream out(output, std::ios::binary);
  LOOM_CHECK(out.good(), "cannot write ", output);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  out.close();
  LOOM_CHECK(out.good(), "writing ", output, " failed");
  size_t points = 0;
  for (const auto& s : fig.series) points += s.train.size() + s.val.size();
  std::fprintf(stderr, "loom plot: %zu run(s), %zu points -> %s\n", fig.series.size(), points,
               output.c_str());
  return 0;
}

}  // namespace loom
