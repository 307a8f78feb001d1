# The CUDA backend (docs/decisions/cuda.md), optional at build time:
#   LOOM_CUDA=AUTO (default) builds it where nvcc and cuBLASLt are found, and otherwise prints one
#   line and builds the CPU loom exactly as without this file; ON requires it; OFF skips it.
# cudart is linked statically (it loads the driver itself, so the binary starts where there is no
# GPU or driver), cuBLASLt dynamically (libcublasLt.so.13).
set(LOOM_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO, ON or OFF")
set_property(CACHE LOOM_CUDA PROPERTY STRINGS AUTO ON OFF)
# Hopper's own code (wgmma needs sm_90a) and PTX that newer GPUs compile at load.
set(LOOM_CUDA_GENCODE
    "-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_90,code=compute_90"
    CACHE STRING "nvcc -gencode flags of the CUDA backend")
set(LOOM_HAVE_CUDA OFF)
if(NOT LOOM_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    find_package(CUDAToolkit QUIET)
  endif()
  if(CMAKE_CUDA_COMPILER AND TARGET CUDA::cublasLt AND TARGET CUDA::cudart_static)
    set(LOOM_HAVE_CUDA ON)
  elseif(LOOM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "LOOM_CUDA=ON, but no CUDA toolkit with nvcc and cuBLASLt was found "
                        "(CUDACXX or CUDAToolkit_ROOT name one)")
  else()
    message(NOTICE "loom: no CUDA toolkit (nvcc and cuBLASLt) found: building the CPU loom only")
  endif()
endif()

if(LOOM_HAVE_CUDA)
  # The architectures come from LOOM_CUDA_GENCODE alone (CMake 3.25 has no name for sm_90a).
  set(CMAKE_CUDA_ARCHITECTURES OFF)
  enable_language(CUDA)
  # CMake 3.25 (Debian 12's) has no flag for nvcc's C++20 (3.26 does): CUDA sources take the
  # targets' C++ standard, so name it.
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  message(NOTICE "loom: CUDA backend with nvcc ${CMAKE_CUDA_COMPILER_VERSION} "
                 "(toolkit ${CUDAToolkit_VERSION}, cuBLASLt linked dynamically): ${LOOM_CUDA_GENCODE}")
  file(GLOB cuda_srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/cuda/*.cu
       ${CMAKE_SOURCE_DIR}/kernels/cuda/*.cpp)
  add_library(loom_kernels_cuda STATIC ${cuda_srcs})
  target_include_directories(loom_kernels_cuda PUBLIC ${CMAKE_SOURCE_DIR})
  # kernels/cpu: the argument structs and checks the two backends share (GemmArgs, AdamWArgs, ...);
  # linked only, since its usage requirements (an -isystem /usr/include among them) break nvcc's
  # #include_next <math.h>, and the headers need nothing but the source root.
  target_link_libraries(loom_kernels_cuda PUBLIC loom_core $<LINK_ONLY:loom_kernels_cpu>
                                                 CUDA::cudart_static CUDA::cublasLt)
  # The programs that link it are linked as C++, yet CMake adds nvcc's implicit libraries
  # (-lcudadevrt -lcudart_static) by name: their folder must be searched.
  target_link_directories(loom_kernels_cuda PUBLIC ${CUDAToolkit_LIBRARY_DIR})
  # Whoever links the backend may call it (apps/, ops/); code built without it never sees it.
  target_compile_definitions(loom_kernels_cuda PUBLIC LOOM_CUDA_BACKEND=1)
  target_compile_options(loom_kernels_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:${LOOM_CUDA_GENCODE} -Xcompiler=-Wall,-Wextra,-Werror
      --Werror=all-warnings -Xptxas=-warn-spills>)
endif()
