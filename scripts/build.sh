#!/usr/bin/env bash
# Configures and builds loom (Release) in build/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# The CUDA backend is built where a CUDA toolkit is installed (cmake/cuda.cmake, LOOM_CUDA=AUTO),
# also when its nvcc is not on PATH (the toolkit's usual place).
if ! command -v nvcc > /dev/null && [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)"
