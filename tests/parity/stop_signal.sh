#!/bin/bash
# SIGTERM to one rank of an FSDP 2 run: the ranks agree on the stop flag, so both stop after the
# same step, save one checkpoint of that step and exit 3; each rank's own log ([job] rank_logs)
# records its progress and the stop. The SIGTERM comes twice, as Slurm sends it (from the step
# daemon and again through srun, 0.01-0.2 s apart): the second must not end the rank before its
# save.
#   stop_signal.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/loom_stop.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
source "$src/tests/parity/setup.sh"
parity_corpus "$work/corpus.txt"
"$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
  --save-tokenizer "$work/tok.json" >/dev/null

"$mpiexec" --oversubscribe --allow-run-as-root -np 2 "$loom" train \
  --config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=100000 \
  --training.local_batch_size=4 --checkpoint.dir="$work/ck" --checkpoint.interval=0 \
  --parallelism.dp_shard=2 --job.rank_logs=true --job.dump_dir="$work/runs" \
  --validation.interval=0 >"$work/out.log" 2>&1 &
launcher=$!
# Wait until both ranks have logged a few steps.
for _ in $(seq 200); do
  n0=$(grep -c '^step' "$work/runs/logs/rank-0.log" 2>/dev/null || true)
  n1=$(grep -c '^step' "$work/runs/logs/rank-1.log" 2>/dev/null || true)
  [ "${n0:-0}" -ge 3 ] && [ "${n1:-0}" -ge 3 ] && break
  sleep 0.1
done
# Signal only the last rank (the launcher's newest child), as a scheduler might signal one node.
rank=$(pgrep -n -P "$launcher" loom || pgrep -n -f "loom train --config $src/configs/debug.toml")
kill -TERM "$rank"
sleep 0.1  # delivered apart, not merged into one pending signal
kill -TERM "$rank" 2>/dev/null || true
rc=0
wait "$launcher" || rc=$?
cat "$work/out.log"
for r in 0 1; do echo "== rank $r"; tail -n 3 "$work/runs/logs/rank-$r.log"; done
[ "$rc" = 3 ] || { echo "FAIL: mpirun exit $rc, expected 3 (stopped by a signal)"; exit 1; }
s0=$(grep -o 'stopped by signal at step [0-9]*' "$work/runs/logs/rank-0.log")
s1=$(grep -o 'stopped by signal at step [0-9]*' "$work/runs/logs/rank-1.log")
[ -n "$s0" ] && [ "$s0" = "$s1" ] || { echo "FAIL: ranks stopped at '$s0' and '$s1'"; exit 1; }
step=${s0##* }
ls "$work/ck" | grep -qx "$(printf 'step-%08d' "$step")" ||
  { echo "FAIL: no checkpoint of step $step in $work/ck: $(ls "$work/ck")"; exit 1; }
echo "both ranks stopped after step $step and saved it"
