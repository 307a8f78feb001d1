#!/usr/bin/env bash
# Usage: scripts/cuda_emu_sanitize.sh address|thread [GTEST_FILTER]
# The CUDA backend's kernels on their host emulation (tests/cuda_emu/) under a sanitizer: the
# CPU's stand-ins for what compute-sanitizer does on a GPU, run on every machine with the CUDA
# toolkit (the emulation needs its headers; elsewhere this prints why and exits 0).
#   address: AddressSanitizer + UndefinedBehaviorSanitizer (memcheck): a kernel reading or writing
#            past a tensor (core/allocator.cpp poisons the bytes a block holds past its request
#            and every cached block), past its dynamic shared memory, or out of a stack; the
#            kernel, ops and generation tests, then 20 training steps of the debug Llama on the
#            emulated GPU against the CPU (tests/parity/gpu_step_parity.sh).
#   thread:  ThreadSanitizer (racecheck): two threads of one block touching an address, one of
#            them writing, with no barrier between them (tests/cuda_emu/fibers.hpp); the kernel
#            tests but five attention cases of many blocks (one took 11 minutes under TSan),
#            left to the address pass and the ordinary runs.
# Builds with GCC in build-emu-<sanitizer>/ (its own build dir); GTEST_FILTER replaces the kernel
# tests' filter (default: all but the shapes whose size is the point, as in ctest, and for thread
# the five). Any report fails.
# Environment: SAN_JOBS (build parallelism, default: the cores).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: scripts/cuda_emu_sanitize.sh address|thread [GTEST_FILTER]}
skip="CudaGemm.LlamaShapes:FlashCuda.LlamaShapesAtT2048:CrossEntropyCuda.Vocab128256InChunks"
skip+=":CudaRuntime.CeilingsAreMeasured:CudaRuntimeHost.StartWithoutAGpuNamesWhy"
tsan_heavy="AttentionCuda.ForwardF32MatchesCpu:AttentionCuda.ForwardBf16MatchesCpu"
tsan_heavy+=":AttentionCuda.BackwardBf16MatchesCpu:AttentionCuda.BlockBackwardMatchesCpu"
tsan_heavy+=":FlashCuda.BlockMatchesCpu"
filter=${2:-"-$skip"}
[ "$kind" = thread ] && [ -z "${2:-}" ] && filter+=":$tsan_heavy"
case "$kind" in
  address)
    # Not nonnull-attribute: the tests' memcpy and memcmp of empty vectors (a null pointer with
    # size 0) are undefined by the letter only; a null pointer with a size ASan reports.
    flags="-fsanitize=address,undefined -fno-sanitize=nonnull-attribute"
    flags+=" -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
    targets=(cuda_emu_planted test_kernels_cuda_emulated test_ops_cuda_emulated
             test_model_cuda_emulated loom_emulated parity_compare)
    planted=(read_past use_after_free shared_past)
    report="ERROR: AddressSanitizer" ;;
  thread)
    flags="-fsanitize=thread"
    targets=(cuda_emu_planted test_kernels_cuda_emulated)
    planted=(race_shared race_warp race_global)
    report="WARNING: ThreadSanitizer: data race" ;;
  *) echo "usage: scripts/cuda_emu_sanitize.sh address|thread [GTEST_FILTER]" >&2; exit 2 ;;
esac
if ! command -v nvcc > /dev/null && [ -z "${CUDACXX:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  else
    echo "cuda_emu_sanitize.sh $kind: skipped: no CUDA toolkit (the emulation needs its headers)"
    exit 0
  fi
fi
bdir=build-emu-$kind
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# GCC's flow warnings at -O1 under a sanitizer are false positives (in <regex>, say); the Release
# build is the one held to them (an explicit -Wno- outlasts the -Werror added after it).
cxxflags="$flags -Wno-maybe-uninitialized -Wno-uninitialized -Wno-stringop-overflow"
cxxflags+=" -Wno-stringop-overread -Wno-array-bounds -Wno-restrict"
t0=$(date +%s)
mkdir -p "$bdir"
CCACHE_BASEDIR=$PWD cmake -S . -B "$bdir" -DCMAKE_BUILD_TYPE=San -DLOOM_CUDA=ON "${launcher[@]}" \
  "-DCMAKE_CXX_FLAGS_SAN=-O1 -g1" "-DCMAKE_C_FLAGS_SAN=-O1 -g1" "-DCMAKE_CXX_FLAGS=$cxxflags" \
  "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=$flags" > "$bdir/configure.log" 2>&1 ||
  { cat "$bdir/configure.log"; exit 1; }
CCACHE_BASEDIR=$PWD cmake --build "$bdir" -j "${SAN_JOBS:-$(nproc)}" --target "${targets[@]}" \
  > "$bdir/build.log" 2>&1 || { grep -E -A3 'error|Error' "$bdir/build.log" | head -40; exit 1; }
t1=$(date +%s)
echo "== $bdir built in $((t1 - t0)) s"

# One thread: the CPU reference kernels' OpenMP runtime is not built for ThreadSanitizer.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive LOOM_SOURCE_DIR=$PWD
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
run() {
  local t=$(date +%s)
  "$@"
  echo "== passed in $(( $(date +%s) - t )) s: ${*:1:2}"
}
# First the planted bugs (tests/cuda_emu/planted.cu): each must be reported, their bug-free forms
# not.
for mode in "${planted[@]}"; do
  log=$bdir/planted_$mode.log
  if "$bdir/cuda_emu_planted" "$mode" > "$log" 2>&1 || ! grep -q "$report" "$log"; then
    cat "$log"
    echo "cuda_emu_sanitize.sh $kind: the planted bug $mode was not reported"
    exit 1
  fi
  echo "== planted $mode: reported ($(grep -m1 -oE "$report[^(]*" "$log"))"
done
run "$bdir/cuda_emu_planted" clean
run "$bdir/test_kernels_cuda_emulated" --gtest_brief=1 "--gtest_filter=$filter"
if [ "$kind" = address ]; then
  run "$bdir/test_ops_cuda_emulated" --gtest_brief=1
  run "$bdir/test_model_cuda_emulated" --gtest_brief=1
  run tests/parity/gpu_step_parity.sh "$bdir/loom_emulated" "$bdir/parity_compare" "$PWD" \
    llama_f32 1e-5
fi
echo "cuda_emu_sanitize.sh $kind: clean in $(( $(date +%s) - t0 )) s"
