#pragma once
// Errors carry a message that names what was wrong and what was expected.
#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(str_cat(args...));
}

}  // namespace loom

#define LOOM_CHECK(cond, ...)               \
  do {                                      \
    if (!(cond)) ::loom::fail(__VA_ARGS__); \
  } while (0)
