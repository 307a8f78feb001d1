# `cmake --install build [--prefix P]`: the loom binary in P/bin and the configs (models, jobs and
# hardware files) in P/share/loom/configs, where loom looks for a config given by name beside its
# own binary (train/config.cpp's find_in_configs), so an installed loom runs from any directory.
# `cpack` (in build/) makes a Debian package of the same, its dependencies found by dpkg-shlibdeps
# from the libraries the binary links (oneDNN, Highway, PCRE2, Open MPI, cairo, ...) plus mpirun.
include(GNUInstallDirs)
install(TARGETS loom RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${CMAKE_SOURCE_DIR}/configs/ DESTINATION ${CMAKE_INSTALL_DATADIR}/loom/configs)
install(FILES ${CMAKE_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME loom)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "trains Llama and GLA language models with composable N-D parallelism, in C++")
set(CPACK_PACKAGE_CONTACT "loom developers <loom@localhost>")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# The shared libraries' packages come from dpkg-shlibdeps; mpirun is a program, not a library.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "openmpi-bin")
if(LOOM_HAVE_CUDA)
  # cuBLASLt comes from NVIDIA's toolkit, which no Debian package provides: a package built with
  # the CUDA backend would not install on a plain Debian 12. Build the package with LOOM_CUDA=OFF.
  message(STATUS "loom: cpack's Debian package is meant for a LOOM_CUDA=OFF build "
                 "(cuBLASLt is not a Debian package)")
endif()
include(CPack)
