#include "data/dataset_files.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <memory>

#include "core/error.hpp"
#include "data/compressed_reader.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

std::string suffix_list(const std::vector<std::string>& suffixes) {
  std::string s;
  for (size_t i = 0; i < suffixes.size(); ++i)
    s += (i == 0 ? "" : i + 1 == suffixes.size() ? " or " : ", ") + suffixes[i];
  return s;
}

void expand_directory(const std::string& dir, const std::vector<std::string>& suffixes,
                      DatasetFiles& out) {
  std::vector<std::string> found, skipped;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  LOOM_CHECK(!ec, "cannot list the input directory '", dir, "': ", ec.message());
  for (; it != end; it.increment(ec)) {
    LOOM_CHECK(!ec, "cannot list the input directory '", dir, "': ", ec.message());
    const fs::path& p = it->path();
    if (p.filename().string().rfind('.', 0) == 0) {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file(ec)) continue;  // directories are walked, sockets and the like left
    (has_dataset_suffix(p.string(), suffixes) ? found : skipped).push_back(p.string());
  }
  LOOM_CHECK(!found.empty(), "input directory '", dir, "' holds no file ending in ",
             suffix_list(suffixes), " (optionally followed by .gz or .zst)");
  // Byte order of the whole path: the same on every file system and in every locale.
  std::sort(found.begin(), found.end());
  out.files.insert(out.files.end(), found.begin(), found.end());
  if (!skipped.empty()) {
    std::sort(skipped.begin(), skipped.end());
    out.notes.push_back(str_cat("input directory '", dir, "': ", skipped.size(),
                                " file(s) not ending in ", suffix_list(suffixes),
                                " (optionally .gz or .zst) skipped, e.g. '", skipped.front(), "'"));
  }
}

void add_existing(const std::string& path, const std::vector<std::string>& suffixes,
                  DatasetFiles& out) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (fs::is_directory(st)) {
    expand_directory(path, suffixes, out);
    return;
  }
  LOOM_CHECK(fs::is_regular_file(st), "input '", path, "' is not a regular file or a directory");
  out.files.push_back(path);
}

struct GlobFree {
  void operator()(glob_t* g) const { globfree(g); }
};

std::vector<std::string> glob_sorted(const std::string& pattern) {
  glob_t g{};
  const int rc = glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  const std::unique_ptr<glob_t, GlobFree> hold(&g);
  LOOM_CHECK(rc != GLOB_NOMATCH, "input pattern '", pattern, "' matches no file");
  LOOM_CHECK(rc == 0, "input pattern '", pattern, "': glob failed (",
             rc == GLOB_ABORTED ? "a directory could not be read" : "out of memory", ")");
  std::vector<std::string> paths(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  std::sort(paths.begin(), paths.end());  // glob sorts by the locale's collation
  return paths;
}

}  // namespace

bool has_dataset_suffix(const std::string& path, const std::vector<std::string>& suffixes) {
  const std::string name = without_compression_suffix(fs::path(path).filename().string());
  for (const auto& s : suffixes)
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
      return true;
  return false;
}

DatasetFiles expand_dataset_inputs(const std::vector<std::string>& inputs,
                                   const std::vector<std::string>& suffixes) {
  DatasetFiles out;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::exists(in, ec)) {
      add_existing(in, suffixes, out);
      continue;
    }
    if (in.find_first_of("*?[") != std::string::npos) {
      for (const auto& p : glob_sorted(in)) add_existing(p, suffixes, out);
      continue;
    }
    fail("input file '", in, "' does not exist");
  }
  return out;
}

}  // namespace loom
