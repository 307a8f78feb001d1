#!/usr/bin/env bash
# Configures and builds loom (Release) in build/:
#   scripts/build.sh        everything: loom, the tests and the benchmarks (scripts/test.sh, CI)
#   scripts/build.sh loom   the loom binary alone, with only the packages it needs (the quick start)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in
  all) scripts/deps.sh test; tests=ON; targets=() ;;
  loom) scripts/deps.sh build; tests=OFF; targets=(--target loom) ;;
  *) echo "usage: scripts/build.sh [loom]" >&2; exit 2 ;;
esac
# The CUDA backend is built where a CUDA toolkit is installed (cmake/cuda.cmake, LOOM_CUDA=AUTO),
# also when its nvcc is not on PATH (the toolkit's usual place).
if ! command -v nvcc > /dev/null && [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
t0=$(date +%s)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLOOM_TESTS=$tests > /dev/null
cmake --build build -j "$(nproc)" "${targets[@]}"
echo "build.sh: built ${what/all/loom, the tests and the benchmarks} in $(( $(date +%s) - t0 )) s"
