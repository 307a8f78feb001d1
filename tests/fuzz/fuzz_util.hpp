#pragma once
// Helpers of the libFuzzer harnesses (tests/fuzz/README.md): a private scratch directory per
// process (the parsers take paths, so an input is written to a file first), and the oracle: a
// parser may reject an input only with loom::Error (a message naming the file); any other
// exception escaping it, like a crash, a leak or undefined behaviour, is a finding.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>

#include "core/error.hpp"

namespace loom::fuzz {

// A directory of its own under /dev/shm (or $TMPDIR), removed at exit. The exit handler is
// registered once the path is fully built, so it runs before the path is destroyed.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    std::string base = "/dev/shm";
    struct stat st;
    if (::stat(base.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      const char* t = std::getenv("TMPDIR");
      base = t && *t ? t : "/tmp";
    }
    std::string d = base + "/loom_fuzz_XXXXXX";
    if (!::mkdtemp(d.data())) std::abort();
    return d;
  }();
  [[maybe_unused]] static const bool removed_at_exit = [] {
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return true;
  }();
  return dir;
}

inline std::string write_file(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  f.close();
  if (!f) std::abort();
  return path;
}

// Splits at the first occurrence of `sep` (the second part empty if there is none).
inline std::pair<std::string_view, std::string_view> split_at(std::string_view s,
                                                              std::string_view sep) {
  const size_t p = s.find(sep);
  if (p == std::string_view::npos) return {s, {}};
  return {s.substr(0, p), s.substr(p + sep.size())};
}

// Runs `f`; loom::Error is an expected rejection, anything else aborts (a finding).
template <class F>
void expect_loom_errors_only(F&& f) {
  try {
    f();
  } catch (const loom::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: a %s escaped the parser (not loom::Error): %s\n", typeid(e).name(),
                 e.what());
    std::abort();
  }
}

}  // namespace loom::fuzz
