#!/usr/bin/env bash
# Usage: scripts/fuzz.sh [SECONDS_TOTAL]   (default 60; 0 = build and replay the corpora only)
# Builds loom with clang, AddressSanitizer + UndefinedBehaviorSanitizer and libFuzzer's coverage in
# build-fuzz/ (its own build dir; the CPU kernels, which only GCC compiles, come uninstrumented
# from the GCC build in build/), runs the parser tests there (safetensors, llama_config, config,
# tokenizer, token_shard, compressed_reader, checkpoint), then each harness of tests/fuzz/ for its share of
# SECONDS_TOTAL, starting from the seed corpus tests/fuzz/corpus/<harness>/ and the inputs of past
# findings tests/fuzz/regress/<harness>/ (new inputs go to a scratch copy, never into the repo).
# Any crash, sanitizer report, leak, out-of-memory, slow input (10 s) or non-loom::Error exception
# fails the script; the input that caused it is kept in build-fuzz/findings/.
# Environment: FUZZ_JOBS (build parallelism, default 2), FUZZ_ONLY="fuzz_x fuzz_y" (a subset),
# FUZZ_BUILD_DIR (default build-fuzz), FUZZ_SEED (default 1; 0 = random).
set -euo pipefail
cd "$(dirname "$0")/.."
total=${1:-60}
jobs=${FUZZ_JOBS:-2}
bdir=${FUZZ_BUILD_DIR:-build-fuzz}
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
t0=$(date +%s)
# clang cannot compile the CPU kernels: build-fuzz links those of the GCC build in build/.
kernels=$PWD/build/libloom_kernels_cpu.a
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" > /dev/null
fi
CCACHE_BASEDIR=$PWD cmake --build build -j "$jobs" --target loom_kernels_cpu > /dev/null
mkdir -p "$bdir"
CCACHE_BASEDIR=$PWD cmake -S . -B "$bdir" -DLOOM_FUZZ=ON -DLOOM_FUZZ_KERNELS_LIB="$kernels" -DCMAKE_BUILD_TYPE=San \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DLOOM_CUDA=OFF "${launcher[@]}" \
  "-DCMAKE_CXX_FLAGS_SAN=-O1 -g1" "-DCMAKE_C_FLAGS_SAN=-O1 -g1" \
  "-DCMAKE_CXX_FLAGS=$san -fsanitize=fuzzer-no-link" "-DCMAKE_C_FLAGS=$san" \
  "-DCMAKE_EXE_LINKER_FLAGS=$san" > "$bdir/configure.log" 2>&1 ||
  { cat "$bdir/configure.log"; exit 1; }
harnesses=(${FUZZ_ONLY:-fuzz_safetensors fuzz_safetensors_index fuzz_llama_config fuzz_job_config
           fuzz_tokenizer_json fuzz_tiktoken fuzz_gpt2_vocab fuzz_token_shard
           fuzz_checkpoint_state fuzz_compressed_reader})
CCACHE_BASEDIR=$PWD cmake --build "$bdir" -j "$jobs" --target parser_tests_san \
  "${harnesses[@]}" > "$bdir/build.log" 2>&1 || { grep -E -A3 'error|Error' "$bdir/build.log"; exit 1; }
bin=$bdir/tests/fuzz
for t in parser_tests_san "${harnesses[@]}"; do
  [ -x "$bin/$t" ] || { echo "fuzz.sh: $bin/$t was not built"; exit 1; }
done
t1=$(date +%s)
echo "== build-fuzz built in $((t1 - t0)) s"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=passive LOOM_SOURCE_DIR=$PWD
echo "== parser tests under ASan + UBSan"
"$bin/parser_tests_san" --gtest_brief=1
t2=$(date +%s)
echo "== parser tests passed in $((t2 - t1)) s"

per=$(( total / ${#harnesses[@]} ))
[ "$total" -gt 0 ] && [ "$per" -lt 1 ] && per=1
work=$bdir/corpus
mkdir -p "$bdir/findings"
fail=0
printf '%-24s %10s %8s %8s %s\n' harness execs exec/s corpus result
for h in "${harnesses[@]}"; do
  rm -rf "${work:?}/$h"
  mkdir -p "$work/$h"
  for d in "tests/fuzz/corpus/$h" "tests/fuzz/regress/$h"; do
    if [ -d "$d" ]; then cp -r "$d/." "$work/$h/"; fi
  done
  log=$bdir/$h.log
  dict=()
  [ -f "tests/fuzz/dict/$h.dict" ] && dict=("-dict=tests/fuzz/dict/$h.dict")
  if [ "$per" -gt 0 ]; then
    # A fixed seed by default, so that a CI run explores the same inputs as the last one (a new
    # finding then comes from the change, not from luck); FUZZ_SEED=0 draws a random one.
    args=(-seed="${FUZZ_SEED:-1}" -max_total_time="$per" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
          -artifact_prefix="$bdir/findings/$h-" "${dict[@]}" "$work/$h")
  else
    args=(-runs=0 "$work/$h")
  fi
  rc=0
  "$bin/$h" "${args[@]}" > "$log" 2>&1 || rc=$?
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -n1 || true)
  rate=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -n1 || true)
  ncorp=$(find "$work/$h" -type f | wc -l)
  if [ "$rc" -ne 0 ]; then
    fail=1
    printf '%-24s %10s %8s %8s %s\n' "$h" "${execs:--}" "${rate:--}" "$ncorp" "FAILED (rc $rc)"
    grep -E 'ERROR|SUMMARY|fuzz:|runtime error|Test unit written' "$log" | head -20
  else
    printf '%-24s %10s %8s %8s %s\n' "$h" "${execs:--}" "${rate:--}" "$ncorp" ok
  fi
done
echo "== fuzzing took $(( $(date +%s) - t2 )) s (logs: $bdir/fuzz_*.log)"
exit $fail
