// Empty: the fuzz build links the GCC-built kernels instead (tests/fuzz/CMakeLists.txt).
