#pragma once
// What MPI library loom runs on, for `loom info` and the benchmark header.
#include <string>

namespace loom::dist {

// The first line of MPI_Get_library_version (callable before MPI_Init), e.g.
// "Open MPI v4.1.4, package: Debian OpenMPI, ...", and the MPI standard version it implements.
std::string mpi_library_version();
std::string mpi_standard_version();

}  // namespace loom::dist
