// The `loom` command line: dispatches to the subcommands of DESIGN.md.
#include <cstdio>
#include <exception>
#include <string>

#include "core/error.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: loom <train|bench|generate|tokenize|convert|plan> ...\n");
    return 2;
  }
  std::fprintf(stderr, "loom: unknown command '%s'\n", argv[1]);
  return 2;
}
