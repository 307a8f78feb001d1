#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite; then the kernel, model and
# trainer tests and a few parity layouts again on the AVX2 tier (LOOM_CPU_ISA=avx2: loom's kernels
# and oneDNN capped at AVX2), so that every run proves the code path of AVX2-only CPUs too. At the
# end, scripts/fuzz.sh: the parser tests under ASan + UBSan and each fuzz harness for its share of
# LOOM_FUZZ_SECONDS (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build/loom info
ctest --test-dir build --output-on-failure -j "$(nproc)"
if build/loom info --tiers | grep -qx avx2; then
  echo "== again on the AVX2 tier (LOOM_CPU_ISA=avx2)"
  LOOM_CPU_ISA=avx2 ctest --test-dir build --output-on-failure -j "$(nproc)" -L '^(kernels|model|train|tier)$'
fi
scripts/fuzz.sh "${LOOM_FUZZ_SECONDS:-60}"
