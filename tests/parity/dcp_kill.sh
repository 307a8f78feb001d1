#!/bin/bash
# kill -9 during saves. A 2-rank FSDP run saves every step (sync, then async) and is killed with
# SIGKILL (one rank, then every rank) at several moments; each time the job resumes from the
# latest complete checkpoint: whatever the kill left (a step-N.tmp, rank files without an index,
# an index without state.json) is never taken for a checkpoint and is cleaned at start-up.
#   dcp_kill.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup dcp_kill
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.local_batch_size=2
  --parallelism.dp_shard=2 --checkpoint.dir="$work/ck" --checkpoint.interval=1 --checkpoint.keep=2
  --checkpoint.allow_config_change=true)
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=3 >"$work/run.log" 2>&1 ||
  { cat "$work/run.log"; exit 1; }
n=0
for mode in false true; do
  for victims in one all; do
    for delay in 0.3 0.8; do
      n=$((n + 1))
      "${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=100000 \
        --checkpoint.async=$mode --checkpoint.resume=true >"$work/run.log" 2>&1 &
      job=$!
      # The moment is counted from the job's first save: mpirun's start-up alone took more than
      # the old fixed 1.3 s in a fresh Debian root under load (no rank existed yet to kill).
      for _ in $(seq 600); do
        grep -q '^step ' "$work/run.log" 2>/dev/null && break
        kill -0 "$job" 2>/dev/null || break
        sleep 0.1
      done
      sleep "$delay"
      ranks=$(pgrep -P "$job" || true)
      [ -n "$ranks" ] || { echo "run $n: no ranks to kill"; cat "$work/run.log"; exit 1; }
      if [ "$victims" = one ]; then ranks=$(echo "$ranks" | head -1); fi
      kill -9 $ranks
      wait "$job" && { echo "run $n: the job exited 0 after kill -9"; exit 1; } || true
      ls "$work/ck" >"$work/left.txt"
      # The latest complete checkpoint: the highest step-N with state.json.
      latest=$(cd "$work/ck" && for d in step-*; do
        if [[ "$d" =~ ^step-[0-9]+$ ]] && [ -f "$d/state.json" ]; then echo "$d"; fi
      done | sort | tail -1)
      [ -n "$latest" ] || { echo "run $n: no complete checkpoint left"; cat "$work/left.txt"; exit 1; }
      step=$((10#${latest#step-}))
      # One more step from it, in one process: it must load (weights, moments, data position).
      "$loom" train "${common[@]}" --parallelism.dp_shard=1 --training.local_batch_size=4 \
        --training.steps=$((step + 1)) --checkpoint.resume=true >"$work/res.log" 2>&1 ||
        { echo "run $n: resume failed"; cat "$work/left.txt" "$work/res.log"; exit 1; }
      grep -q "resumed from .*$latest (step $step)" "$work/res.log" ||
        { echo "run $n: did not resume from $latest"; cat "$work/left.txt" "$work/res.log"; exit 1; }
      cleaned=$(grep -c "checkpoint.dir: removed" "$work/res.log" || true)
      echo "run $n (async=$mode, kill -9 $victims rank(s) after $delay s): left $(tr '\n' ' ' <"$work/left.txt"); resumed from $latest; $cleaned leftover(s) cleaned"
      for d in "$work"/ck/*; do
        b=$(basename "$d")
        [ "$b" = loom.lock ] && continue  # the run's lock on the directory (train/run_claim.hpp)
        [[ "$b" =~ ^step-[0-9]+$ ]] || { echo "run $n: $b left after the resume"; exit 1; }
        [ -f "$d/state.json" ] || { echo "run $n: $b has no state.json after the resume"; exit 1; }
      done
    done
  done
done
