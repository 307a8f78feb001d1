#!/bin/bash
# `kill -USR1 <mpirun pid>` stops an FSDP 2 job cleanly: mpirun forwards SIGUSR1 to every rank
# (its own SIGTERM and SIGINT kill the ranks instead), the ranks agree on the stop, save the step
# and exit 3, which mpirun returns; resumed, the job gives the losses of an uninterrupted one bit for
# bit. Without a handler, SIGUSR1 killed the ranks (exit 138).
#   stop_mpirun.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup stop_mpirun
# No decay: the number of steps does not change the learning rate of any step, so the interrupted
# job (100000 steps) and the resumed and uninterrupted ones (a few past the stop) share the math.
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --lr_scheduler.decay_type=none
  --validation.interval=0 --parallelism.dp_shard=2 --training.local_batch_size=2)

# The step, loss, lr and grad_norm of each line of metrics files.

"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=100000 --checkpoint.dir="$work/ck" \
  --checkpoint.interval=0 --metrics.jsonl="$work/int.jsonl" --job.rank_logs=true \
  --job.dump_dir="$work/runs" >"$work/int.log" 2>&1 &
launcher=$!
# Until both ranks have logged 3 steps.
for _ in $(seq 600); do
  n0=$(grep -c '^step' "$work/runs/logs/rank-0.log" 2>/dev/null || true)
  n1=$(grep -c '^step' "$work/runs/logs/rank-1.log" 2>/dev/null || true)
  [ "${n0:-0}" -ge 3 ] && [ "${n1:-0}" -ge 3 ] && break
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.1
done
sent=$(date +%s.%N)
kill -USR1 "$launcher"
rc=0
wait "$launcher" || rc=$?
took=$(awk -v a="$sent" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
cat "$work/int.log"
for r in 0 1; do echo "== rank $r"; tail -n 3 "$work/runs/logs/rank-$r.log"; done
[ "$rc" = 3 ] || { echo "FAIL: kill -USR1 mpirun: mpirun exit code $rc, expected 3"; exit 1; }
s0=$(grep -o 'stopped by signal at step [0-9]*' "$work/runs/logs/rank-0.log" || true)
s1=$(grep -o 'stopped by signal at step [0-9]*' "$work/runs/logs/rank-1.log" || true)
[ -n "$s0" ] && [ "$s0" = "$s1" ] || { echo "FAIL: ranks stopped at '$s0' and '$s1'"; exit 1; }
step=${s0##* }
[ -f "$work/ck/$(printf 'step-%08d' "$step")/state.json" ] ||
  { echo "FAIL: no checkpoint of step $step in $work/ck: $(ls "$work/ck")"; exit 1; }
echo "kill -USR1 mpirun: both ranks stopped after step $step, saved it and exited 3 (${took} s)"

# Resumed to 6 steps past the stop, against the same steps run straight through.
end=$((step + 6))
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=$end --checkpoint.dir="$work/ck" \
  --checkpoint.resume=true --metrics.jsonl="$work/res.jsonl" >"$work/res.log" 2>&1 ||
  { cat "$work/res.log"; echo "FAIL: the resume failed"; exit 1; }
grep -q "resumed from .*(step $step)" "$work/res.log" ||
  { cat "$work/res.log"; echo "FAIL: did not resume from step $step"; exit 1; }
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=$end \
  --metrics.jsonl="$work/straight.jsonl" >"$work/straight.log" 2>&1 ||
  { cat "$work/straight.log"; exit 1; }
resumed_equals_straight "$work/int.jsonl" "$work/res.jsonl" "$work/straight.jsonl"
