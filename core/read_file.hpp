#pragma once
// A whole file read into memory, for the small text files loom reads at once (configs, JSON of a
// checkpoint, a tokenizer to copy).
#include <string>
#include <string_view>

namespace loom {

// The bytes of the file at `path`. An error when it cannot be opened or read: "cannot open WHAT
// 'PATH'" or "cannot read WHAT 'PATH'", `what` saying what the file is ("model config"), or
// "cannot open 'PATH'" without it.
std::string read_file(const std::string& path, std::string_view what = {});

}  // namespace loom
