# The CUDA emulation (tests/cuda_emu/device.hpp): the CUDA backend's own sources, kernels/cuda/*,
# compiled by g++ for the host against emulated CUDA runtime, cuBLASLt and CUB calls, and the CUDA
# kernel tests (tests/kernels/cuda/) run on it: every kernel's code is exercised on machines
# without a GPU. Built where the CUDA backend is (its headers give the runtime's types).
#
# tests/cuda_emu/cu_to_cpp.cpp makes each .cu file C++ (its launches calls of the emulation's
# launch, its dynamic shared memory a pointer), at build time.
add_executable(loom_cu_to_cpp ${CMAKE_SOURCE_DIR}/tests/cuda_emu/cu_to_cpp.cpp)
file(GLOB emu_cu CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/cuda/*.cu)
set(emu_srcs)
foreach(cu ${emu_cu})
  get_filename_component(name ${cu} NAME_WE)
  set(out ${CMAKE_BINARY_DIR}/cuda_emu/${name}.cpp)
  add_custom_command(OUTPUT ${out} COMMAND loom_cu_to_cpp ${cu} ${out}
                     DEPENDS ${cu} loom_cu_to_cpp VERBATIM)
  list(APPEND emu_srcs ${out})
endforeach()
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/cuda_emu)
set_source_files_properties(${emu_srcs} PROPERTIES
  COMPILE_OPTIONS "-include;${CMAKE_SOURCE_DIR}/tests/cuda_emu/device.hpp")
add_library(loom_kernels_cuda_emu STATIC ${emu_srcs}
            ${CMAKE_SOURCE_DIR}/kernels/cuda/runtime.cpp ${CMAKE_SOURCE_DIR}/kernels/cuda/gemm.cpp
            ${CMAKE_SOURCE_DIR}/tests/cuda_emu/cudart.cpp
            ${CMAKE_SOURCE_DIR}/tests/cuda_emu/cublaslt.cpp)
# The emulation's CUB and flash primitives come before the real ones.
target_include_directories(loom_kernels_cuda_emu BEFORE PUBLIC ${CMAKE_SOURCE_DIR}/tests/cuda_emu/include)
target_include_directories(loom_kernels_cuda_emu PUBLIC ${CMAKE_SOURCE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
target_link_libraries(loom_kernels_cuda_emu PUBLIC loom_core loom_kernels_cpu)
target_compile_definitions(loom_kernels_cuda_emu PUBLIC LOOM_CUDA_BACKEND=1
                           PRIVATE LOOM_CUDA_EMULATION=1)
# The device's round-to-nearest intrinsics are the plain operations only if nothing is contracted
# into an FMA; `#pragma unroll` is nvcc's.
target_compile_options(loom_kernels_cuda_emu PRIVATE -ffp-contract=off -Wno-unknown-pragmas)
set_target_properties(loom_kernels_cuda_emu PROPERTIES UNITY_BUILD OFF)

file(GLOB emu_test_srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/tests/kernels/cuda/*.cpp)
add_executable(test_kernels_cuda_emulated ${emu_test_srcs})
target_link_libraries(test_kernels_cuda_emulated PRIVATE loom_kernels_cuda_emu GTest::gtest_main)
set_target_properties(test_kernels_cuda_emulated PROPERTIES UNITY_BUILD OFF)

# The layers above the kernels on the emulated GPU: their objects as built for loom (with the CUDA
# backend of the ops), linked against the emulated kernels instead of the real ones.
add_executable(test_ops_cuda_emulated ${CMAKE_SOURCE_DIR}/tests/ops/cuda/ops_cuda_test.cpp
                                      $<TARGET_OBJECTS:loom_ops>)
target_link_libraries(test_ops_cuda_emulated PRIVATE loom_kernels_cuda_emu OpenMP::OpenMP_CXX
                                                     GTest::gtest_main)
add_executable(test_model_cuda_emulated ${CMAKE_SOURCE_DIR}/tests/model/cuda/inference_cuda_test.cpp
               $<TARGET_OBJECTS:loom_model> $<TARGET_OBJECTS:loom_parallel_layers>
               $<TARGET_OBJECTS:loom_ops>)
target_link_libraries(test_model_cuda_emulated PRIVATE loom_kernels_cuda_emu loom_distributed
                      nlohmann_json::nlohmann_json loom_xxhash OpenMP::OpenMP_CXX GTest::gtest_main)
# The whole loom on the emulated GPU: `loom_emulated train --training.device=cuda` trains on it
# (tests/parity/gpu_step_parity.sh runs it so, on small models: ctest gpu_step_parity_emulated_*).
add_executable(loom_emulated $<TARGET_OBJECTS:loom_apps> $<TARGET_OBJECTS:loom_plan>
               $<TARGET_OBJECTS:loom_train> $<TARGET_OBJECTS:loom_parallel>
               $<TARGET_OBJECTS:loom_model> $<TARGET_OBJECTS:loom_parallel_layers>
               $<TARGET_OBJECTS:loom_ops>)
target_link_libraries(loom_emulated PRIVATE loom_kernels_cuda_emu loom_data loom_pipeline
                      loom_distributed loom_xxhash nlohmann_json::nlohmann_json
                      tomlplusplus::tomlplusplus protobuf::libprotobuf-lite PkgConfig::ISAL
                      PkgConfig::CAIRO OpenMP::OpenMP_CXX)
set_target_properties(test_ops_cuda_emulated test_model_cuda_emulated loom_emulated
                      PROPERTIES UNITY_BUILD OFF)

# Kernels with planted bugs (tests/cuda_emu/planted.cu) that scripts/cuda_emu_sanitize.sh holds
# each sanitizer to reporting; in ctest their bug-free forms.
set(planted ${CMAKE_BINARY_DIR}/cuda_emu/planted.cpp)
add_custom_command(OUTPUT ${planted}
                   COMMAND loom_cu_to_cpp ${CMAKE_SOURCE_DIR}/tests/cuda_emu/planted.cu ${planted}
                   DEPENDS ${CMAKE_SOURCE_DIR}/tests/cuda_emu/planted.cu loom_cu_to_cpp VERBATIM)
add_executable(cuda_emu_planted ${planted})
set_source_files_properties(${planted} PROPERTIES
  COMPILE_OPTIONS "-include;${CMAKE_SOURCE_DIR}/tests/cuda_emu/device.hpp")
target_link_libraries(cuda_emu_planted PRIVATE loom_kernels_cuda_emu)
add_test(NAME cuda_emu_planted_clean COMMAND cuda_emu_planted clean)
set_tests_properties(cuda_emu_planted_clean PROPERTIES LABELS cuda_emu)

# In ctest (label cuda_emu). Left out: the shapes whose size is the point (the Llama 3.2 1B and
# Llama 3 8B shapes, vocab 128256, the 8192^3 ceiling GEMM), minutes each on the emulation; they
# run on the GPU (scripts/device_check.sh).
set(emu_skip "CudaGemm.LlamaShapes:FlashCuda.LlamaShapesAtT2048:CrossEntropyCuda.Vocab128256InChunks:CudaRuntime.CeilingsAreMeasured:CudaRuntimeHost.StartWithoutAGpuNamesWhy")
foreach(t test_kernels_cuda_emulated test_ops_cuda_emulated test_model_cuda_emulated)
  gtest_discover_tests(${t} DISCOVERY_TIMEOUT 60 TEST_PREFIX "emulated."
    TEST_FILTER "-${emu_skip}"
    PROPERTIES LABELS cuda_emu ENVIRONMENT "LOOM_SOURCE_DIR=${CMAKE_SOURCE_DIR}"
               ENVIRONMENT_MODIFICATION "OMP_WAIT_POLICY=set:passive")
endforeach()
