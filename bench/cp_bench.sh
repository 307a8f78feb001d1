#!/bin/bash
# Longest trainable sequence under a per-rank memory cap (--memory.limit_gb, the allocator's
# limit) for cp = 1, 2, 4, 8 (FSDP over the cp ranks, local batch 1), and tokens/s at that length.
#   [CPS="1 2 4"] bench/cp_bench.sh BUILD_DIR [LIMIT_GB] [MODEL_CONFIG]
# A length "fits" when 3 training steps complete under the cap. Search: doubling from 256, then
# bisection down to a step of 2*cp*64 tokens. No activation checkpointing exists yet, so every
# rank keeps all of its layers' activations of its seq_len / cp tokens.
set -euo pipefail
build=$1 limit=${2:-0.05} model=${3:-debug}
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_cp_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
cat "$src"/docs/design.md "$src"/train/*.cpp >"$work/corpus.txt"
"$build/loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null
fits() {  # fits CP LEN: 0 when 3 steps train under the cap; the last step's line in $work/last
  local cp=$1 len=$2
  mpiexec --oversubscribe --allow-run-as-root -np "$cp" "$build/loom" train \
    --config "$src/configs/debug.toml" --data.path="$work/data" --model.config="$model" \
    --training.seq_len="$len" --training.local_batch_size=1 --training.steps=3 \
    --checkpoint.interval=0 --memory.limit_gb="$limit" --parallelism.dp_shard=1 \
    --parallelism.cp="$cp" >"$work/log" 2>&1 || return 1
  grep -ao "step 3/3 [^[:cntrl:]]*" "$work/log" >"$work/last"
}
printf "memory.limit_gb = %s per rank, model %s, local batch 1\n" "$limit" "$model"
printf "%4s %10s %12s %10s\n" cp max_seq tokens/s vs_cp1
base=0
for cp in ${CPS:-1 2 4 8}; do
  q=$((2 * cp * 64))  # granularity
  lo=0 hi=$q
  while fits "$cp" "$hi"; do lo=$hi; hi=$((hi * 2)); done
  while [ $((hi - lo)) -gt "$q" ]; do
    mid=$(((lo + hi) / 2 / q * q))
    if fits "$cp" "$mid"; then lo=$mid; else hi=$mid; fi
  done
  tps="-"
  if [ "$lo" -gt 0 ]; then
    fits "$cp" "$lo"
    tps=$(grep -o '[0-9.]*k\? tok/s' "$work/last" | cut -d' ' -f1)
  fi
  [ "$cp" = 1 ] && base=$lo
  printf "%4s %10s %12s %10s\n" "$cp" "$lo" "$tps" "$(awk -v a="$lo" -v b="$base" 'BEGIN{printf "%.2fx", b ? a / b : 0}')"
done
