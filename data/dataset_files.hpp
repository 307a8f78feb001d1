#pragma once
// The files of a text dataset named on a command line, as people have them: files, directories
// and glob patterns, in an order that does not depend on the file system, so the same inputs
// always make the same token stream.
#include <string>
#include <vector>

namespace loom {

struct DatasetFiles {
  std::vector<std::string> files;  // in stream order
  // What was left out and why ("directory 'd': 2 file(s) without a known suffix skipped ..."),
  // for the command to print.
  std::vector<std::string> notes;
};

// Whether path's name, under a ".gz" or ".zst" suffix if it has one, ends in one of suffixes
// ("x.jsonl.zst" has ".jsonl").
bool has_dataset_suffix(const std::string& path, const std::vector<std::string>& suffixes);

// Each input in order becomes:
// - a file: itself, whatever its name;
// - a directory: every regular file under it (recursively, symbolic links to files followed)
//   with one of suffixes, sorted by path; names starting with '.' (files and directories) are
//   skipped as a shell's * skips them;
// - a path that does not exist but holds *, ? or [: a glob(3) pattern (the shell left it
//   unexpanded, e.g. quoted), its matches sorted by path, a matching directory expanded as above.
// A path that does not exist, a pattern that matches nothing, or a directory that holds no file
// with one of suffixes is an Error naming it and what was expected.
DatasetFiles expand_dataset_inputs(const std::vector<std::string>& inputs,
                                   const std::vector<std::string>& suffixes);

}  // namespace loom
