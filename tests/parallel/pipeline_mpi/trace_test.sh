#!/bin/bash
# [profiling] trace under pp: every rank writes DIR/rank-R.json, and in every step span each
# action of its schedule list appears once per round, in the list's order (pp_trace check):
# pp 2 1f1b with grad_accum_steps 2 (two rounds a step), pp 2 interleaved, zbv (F, I and W
# actions, two stages per rank in a V), pp 2 x tp 2 (world ranks 0-1 are pp rank 0). The
# anti-check: the check against another schedule must fail.
#   trace_test.sh LOOM MPIEXEC PP_TRACE SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 pp_trace=$3 src=$4
source "$src/tests/parity/setup.sh"
parity_setup pp_trace
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.steps=3
  --model.config="$src/tests/parity/pp_debug.json" --training.local_batch_size=1
  --checkpoint.interval=0)
run() {  # run NAME NP ARGS...
  local name=$1 np=$2
  shift 2
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --profiling.trace="$work/$name" "$@" \
    >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; return 1; }
}
run 1f1b 2 --parallelism.pp=2 --parallelism.pp_microbatches=4 --training.grad_accum_steps=2
"$pp_trace" check "$work/1f1b" 1f1b 2 1 4 3
run interleaved 2 --parallelism.pp=2 --parallelism.pp_microbatches=4 \
  --parallelism.pp_schedule=interleaved_1f1b
"$pp_trace" check "$work/interleaved" interleaved_1f1b 2 2 4 3
run zbv 2 --parallelism.pp=2 --parallelism.pp_microbatches=4 --parallelism.pp_schedule=zbv
"$pp_trace" check "$work/zbv" zbv 2 2 4 3
run tp2 4 --parallelism.pp=2 --parallelism.tp=2 --parallelism.pp_microbatches=2
"$pp_trace" check "$work/tp2" 1f1b 2 1 2 3
# Each rank's file is a Chrome trace with the step spans' CPU time.
grep -q '"cat": "step", "ph": "X"' "$work/tp2/rank-3.json"
grep -q '"cpu_us": ' "$work/tp2/rank-3.json"
if "$pp_trace" check "$work/1f1b" gpipe 2 1 4 3 >"$work/anti.log"; then
  echo "the check passed against gpipe for a 1f1b trace"
  cat "$work/anti.log"
  exit 1
fi
echo "a 1f1b trace checked as gpipe fails, as expected"
