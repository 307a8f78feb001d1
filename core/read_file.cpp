#include "core/read_file.hpp"

#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace loom {

std::string read_file(const std::string& path, std::string_view what) {
  const std::string named = what.empty() ? str_cat("'", path, "'") : str_cat(what, " '", path, "'");
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "cannot open ", named);
  std::ostringstream ss;
  ss << f.rdbuf();
  LOOM_CHECK(!f.bad(), "cannot read ", named);
  return ss.str();
}

}  // namespace loom
