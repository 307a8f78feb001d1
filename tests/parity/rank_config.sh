#!/bin/bash
# The ranks of a job compare their resolved configuration and their binary at start-up: MPMD
# launches where rank 1 alone gets another optimizer.lr (which would train with two learning
# rates), another training.steps (which would wait in a collective for the 300 s timeout) or
# another copy of the loom binary must end within 30 s, non-zero, naming the key (or the binary).
# Without the check the job would wait for the 300 s collective timeout; the bound was 10 s, but a
# 2-rank launch alone took 10.9 s under load 11 in a fresh Debian root (CI beside a benchmark).
# Then identical ranks train, and their progress goes to a log file as plain lines: Open MPI gives
# ranks a pseudo-terminal, so isatty() alone would draw the live line (\r, escapes) into the file.
#   rank_config.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup rank_config
common=(train --config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=3
  --training.local_batch_size=1 --checkpoint.interval=0 --parallelism.dp_shard=2)
status=0

# rank1_differs NAME PATTERN LOOM1 ARGS...: rank 1 runs LOOM1 with ARGS added.
rank1_differs() {
  local name=$1 pat=$2 loom1=$3
  shift 3
  local rc=0 t0 t1 secs
  t0=$(date +%s.%N)
  timeout -k 5 60 "${mpi[@]}" -np 1 "$loom" "${common[@]}" : \
    -np 1 "$loom1" "${common[@]}" "$@" >"$work/$name.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  if [ "$rc" != 0 ] && [ "$rc" != 124 ] && awk -v s="$secs" 'BEGIN { exit !(s < 30) }' &&
    grep -q -- "$pat" "$work/$name.log"; then
    echo "ok: $name: exit $rc after $secs s: $(grep -m1 -o -- "$pat.*" "$work/$name.log" | cut -c1-150)"
  else
    echo "FAILED: $name: exit $rc after $secs s (want non-zero within 30 s, naming '$pat'):"
    tail -8 "$work/$name.log"
    status=1
  fi
}

rank1_differs lr "optimizer.lr = 0.001 on rank 0, 0.002 on rank 1" "$loom" --optimizer.lr=2e-3
rank1_differs steps "training.steps = 3 on rank 0, 5 on rank 1" "$loom" --training.steps=5
# The same program with one byte more: another binary.
cp "$loom" "$work/loom-other"
printf 'x' >>"$work/loom-other"
rank1_differs binary "rank 1 run(s) another loom binary than rank 0" "$work/loom-other"
# The same everything still trains.
rc=0
timeout -k 5 60 "${mpi[@]}" -np 2 "$loom" "${common[@]}" >"$work/same.log" 2>&1 || rc=$?
if [ "$rc" = 0 ] && grep -q "step 3/3" "$work/same.log" && ! grep -q $'\r' "$work/same.log"; then
  echo "ok: identical ranks train, plain progress lines in a log file"
else
  echo "FAILED: identical ranks: exit $rc"
  tail -8 "$work/same.log"
  status=1
fi
exit $status
