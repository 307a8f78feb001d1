#include "distributed/mpi_info.hpp"

#include <mpi.h>

namespace loom::dist {

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(buf, &len) != MPI_SUCCESS) return "unknown";
  std::string s(buf, size_t(len > 0 ? len : 0));
  if (const size_t nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\0' || s.back() == '\r')) s.pop_back();
  return s.empty() ? "unknown" : s;
}

std::string mpi_standard_version() {
  int major = 0, minor = 0;
  if (MPI_Get_version(&major, &minor) != MPI_SUCCESS) return "unknown";
  return std::to_string(major) + "." + std::to_string(minor);
}

}  // namespace loom::dist
