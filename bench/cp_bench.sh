#!/bin/bash
# Longest trainable sequence under a per-rank memory cap (--memory.limit_gb, the allocator's
# limit) for cp = 1, 2, 4, 8 (FSDP over the cp ranks, local batch 1), and tokens/s at that length.
#   [CPS="1 2 4 8"] [AC=none|full] [FIXED=LEN] bench/cp_bench.sh BUILD_DIR [LIMIT_GB] [MODEL_CONFIG]
# A length "fits" when 2 training steps complete under the cap (the peak is reached in the first
# step; the second one proves the optimizer state fits too). The search starts at cp x the cp 1
# result (linear scaling), gallops up or down by doubling, then bisects to a step of 2*cp*64
# tokens. tokens/s is the last of 4 steps at the longest length (cp ranks share this machine's
# cores, so compare the trend, not the absolute figure, with a real cluster). Every rank runs
# OMP_NUM_THREADS threads (default 1): cp 1 uses one core where cp >= 2 uses min(cp, cores), so
# the tables also print tokens/s per core in use.
# FIXED=LEN adds a second table: every cp at the same seq_len (no cap), tokens/s and peak memory
# per rank, i.e. what cp costs in throughput at equal work. LIMIT_GB 0 runs only that table.
set -euo pipefail
build=$1 limit=${2:-0.05} model=${3:-debug} ac=${AC:-none} cps=${CPS:-1 2 4 8}
first=${cps%% *}
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_cp_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=passive
cat "$src"/docs/*.md "$src"/docs/decisions/*.md "$src"/train/*.cpp >"$work/corpus.txt"
"$build/loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null
run() {  # run CP LEN STEPS: 0 when STEPS steps train under the cap; the last step's line in $work/last
  local cp=$1 len=$2 steps=$3
  mpiexec --oversubscribe --allow-run-as-root -np "$cp" "$build/loom" train \
    --config "$src/configs/debug.toml" --data.path="$work/data" --model.config="$model" \
    --training.seq_len="$len" --training.local_batch_size=1 --training.steps="$steps" \
    --checkpoint.interval=0 --memory.limit_gb="$limit" --parallelism.dp_shard=1 \
    --parallelism.cp="$cp" --activation_checkpoint.mode="$ac" >"$work/log" 2>&1 || return 1
  grep -ao "step $steps/$steps [^[:cntrl:]]*" "$work/log" >"$work/last"
}
fits() { run "$1" "$2" 2; }
tps() {  # tps CP: "TOKENS/S PER_CORE" of the step line in $work/last
  local t cores
  t=$(grep -o '[0-9.]*k\? tok/s' "$work/last" | cut -d' ' -f1)
  cores=$((OMP_NUM_THREADS * $1 < $(getconf _NPROCESSORS_ONLN) ? OMP_NUM_THREADS * $1 : $(getconf _NPROCESSORS_ONLN)))
  awk -v t="$t" -v c="$cores" 'BEGIN{v = t; if (t ~ /k$/) v = substr(t, 1, length(t) - 1) * 1000;
    printf "%s %.0f", t, v / c}'
}
search() {
  printf "memory.limit_gb = %s per rank, model %s, local batch 1, activation_checkpoint %s\n" \
    "$limit" "$model" "$ac"
  printf "%4s %10s %12s %10s %10s %8s\n" cp max_seq tokens/s per_core vs_cp1 tries
  base=0
  for cp in $cps; do
    q=$((2 * cp * 64))  # granularity
    guess=$((base > 0 ? base * cp / q * q : q))
    [ "$guess" -lt "$q" ] && guess=$q
    tries=1
    if fits "$cp" "$guess"; then
      lo=$guess hi=$((guess * 2))
      while tries=$((tries + 1)) && fits "$cp" "$hi"; do lo=$hi; hi=$((hi * 2)); done
    else
      hi=$guess lo=$((guess / 2 / q * q))
      while [ "$lo" -gt 0 ] && tries=$((tries + 1)) && ! fits "$cp" "$lo"; do
        hi=$lo; lo=$((lo / 2 / q * q))
      done
    fi
    while [ $((hi - lo)) -gt "$q" ]; do
      mid=$(((lo + hi) / 2 / q * q))
      tries=$((tries + 1))
      if fits "$cp" "$mid"; then lo=$mid; else hi=$mid; fi
    done
    rate="- -"
    if [ "$lo" -gt 0 ] && run "$cp" "$lo" 4; then rate=$(tps "$cp"); fi
    [ "$cp" = "$first" ] && base=$lo
    printf "%4s %10s %12s %10s %10s %8s\n" "$cp" "$lo" ${rate} \
      "$(awk -v a="$lo" -v b="$base" 'BEGIN{printf "%.2fx", b ? a / b : 0}')" "$tries"
  done
}
[ "$limit" != 0 ] && search
[ -z "${FIXED:-}" ] && exit 0
limit=0
printf "\nseq_len %s for every cp, no cap:\n%4s %12s %10s %14s\n" "$FIXED" cp tokens/s per_core \
  "peak per rank"
for cp in $cps; do
  if run "$cp" "$FIXED" 4; then
    printf "%4s %12s %10s %14s\n" "$cp" $(tps "$cp") \
      "$(grep -o 'mem [0-9.]* [GMK]iB' "$work/last" | cut -d' ' -f2-)"
  else
    printf "%4s %12s\n" "$cp" "failed"
  fi
done
