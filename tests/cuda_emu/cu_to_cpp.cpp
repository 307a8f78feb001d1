// cu_to_cpp IN.cu OUT.cpp: the textual rewrite that makes a kernels/cuda/*.cu file C++ for the CUDA
// emulation (tests/cuda_emu/device.hpp; cmake/cuda_emu.cmake runs it at build time):
//   KERNEL<<<CONFIG>>>(ARGS)
//     -> ::loom::cuda_emu::launch(::loom::cuda_emu::Config(CONFIG),
//                                 [&](const auto&... a) { KERNEL(a...); }, ARGS)
//   extern __shared__ [__align__(N)] T NAME[];  ->  T* NAME = ::loom::cuda_emu::dynamic_smem<T>();
// The kernel is called as written, so a kernel template's arguments are deduced from the call's as
// nvcc deduces them. Line numbers are kept (a #line names the original file), so the compiler's
// messages point into the .cu file.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>

namespace {

[[noreturn]] void die(const std::string& file, const std::string& text, size_t at,
                      const std::string& what) {
  const long line = 1 + long(std::count(text.begin(), text.begin() + long(at), '\n'));
  std::cerr << file << ":" << line << ": cu_to_cpp: " << what << "\n";
  std::exit(1);
}

bool in_line_comment(const std::string& s, size_t at) {
  const size_t bol = s.rfind('\n', at);
  const size_t c = s.find("//", bol == std::string::npos ? 0 : bol);
  return c != std::string::npos && c < at;
}

size_t newlines(const std::string& s, size_t from, size_t to) {
  return size_t(std::count(s.begin() + long(from), s.begin() + long(to), '\n'));
}

std::string rewrite_launches(const std::string& file, std::string s) {
  size_t pos = 0;
  while ((pos = s.find("<<<", pos)) != std::string::npos) {
    if (in_line_comment(s, pos)) {
      pos += 3;
      continue;
    }
    // The kernel expression before <<<: a name (with ::), then a template argument list.
    size_t b = pos;
    while (b > 0 && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    const size_t kernel_end = b;
    if (b > 0 && s[b - 1] == '>') {
      int depth = 0;
      do {
        --b;
        if (s[b] == '>') ++depth;
        if (s[b] == '<') --depth;
      } while (b > 0 && depth > 0);
      if (depth != 0) die(file, s, pos, "unbalanced template arguments before <<<");
      while (b > 0 && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    }
    while (b > 0 && (std::isalnum(static_cast<unsigned char>(s[b - 1])) || s[b - 1] == '_' ||
                     s[b - 1] == ':'))
      --b;
    if (b == kernel_end) die(file, s, pos, "no kernel name before <<<");
    const size_t cfg_end = s.find(">>>", pos);
    if (cfg_end == std::string::npos) die(file, s, pos, "<<< without >>>");
    size_t open = cfg_end + 3;
    while (open < s.size() && std::isspace(static_cast<unsigned char>(s[open]))) ++open;
    if (open >= s.size() || s[open] != '(') die(file, s, pos, "no argument list after >>>");
    size_t close = open;
    int depth = 0;
    for (; close < s.size(); ++close) {
      if (s[close] == '(') ++depth;
      if (s[close] == ')' && --depth == 0) break;
    }
    if (close >= s.size()) die(file, s, pos, "unbalanced argument list");
    const std::string kernel = s.substr(b, kernel_end - b);
    const std::string config = s.substr(pos + 3, cfg_end - pos - 3);
    const std::string args = s.substr(open + 1, close - open - 1);
    const bool no_args = args.find_first_not_of(" \t\r\n") == std::string::npos;
    std::string out = "::loom::cuda_emu::launch(::loom::cuda_emu::Config(" + config +
                      "), [&](const auto&... loom_emu_a) { " + kernel + "(loom_emu_a...); }" +
                      (no_args ? std::string() : ", " + args) + ")";
    // The newlines between the pieces, so that every later line keeps its number.
    out += std::string(newlines(s, kernel_end, pos) + newlines(s, cfg_end, open), '\n');
    s.replace(b, close + 1 - b, out);
    pos = b + out.size();
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: cu_to_cpp IN.cu OUT.cpp\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  if (!in) {
    std::cerr << "cu_to_cpp: cannot read " << argv[1] << "\n";
    return 1;
  }
  std::stringstream buf;
  buf << in.rdbuf();
  std::string s = rewrite_launches(argv[1], buf.str());
  static const std::regex dyn(
      R"(extern __shared__ (__align__\([0-9]+\) )?([A-Za-z_0-9:]+) ([A-Za-z_0-9]+)\[\];)");
  s = std::regex_replace(s, dyn, "$2* $3 = ::loom::cuda_emu::dynamic_smem<$2>();");
  std::ofstream out(argv[2]);
  out << "#line 1 \"" << argv[1] << "\"\n" << s;
  if (!out) {
    std::cerr << "cu_to_cpp: cannot write " << argv[2] << "\n";
    return 1;
  }
  return 0;
}
