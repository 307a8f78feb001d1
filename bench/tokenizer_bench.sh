#!/usr/bin/env bash
# Encode throughput of loom's tokenizer next to the npm references on the same texts:
#   bench/tokenizer_bench.sh [BUILD_DIR]     (default: build; needs the tokenizer_bench target)
# Makes the fixtures (tests/tokenizer/setup.sh), then runs BUILD_DIR/bench/tokenizer_bench (loom:
# load time, MB/s, parity, training time) and bench/tokenizer_bench.mjs (gpt-tokenizer,
# llama3-tokenizer-js). MB/s is the median of 3 wall-clock runs on one thread.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
fixtures="$build/tokenizer_fixtures"
"$root/tests/tokenizer/setup.sh" "$fixtures"
[ -x "$build/bench/tokenizer_bench" ] ||
  { echo "build the tokenizer_bench target first: cmake --build $build --target tokenizer_bench" >&2; exit 1; }
echo "== loom"
"$build/bench/tokenizer_bench" "$fixtures"
echo "== npm references"
node "$root/bench/tokenizer_bench.mjs" "$fixtures"
