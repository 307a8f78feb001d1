#!/bin/bash
# A checkpoint taken under pp 2 x tp 2 (1f1b, 4 micro-batches of 1 sample) resumes under one
# process (grad_accum_steps 4), pp 4 (interleaved, 8 stages) and FSDP 2 x TP 2 with the
# uninterrupted run's step-11 loss within 1e-6 relative (why not to the last digit: see
# restart_layouts.sh). Every pp rank holds only its stages' weights and moments up to date; the
# checkpoint must still hold every unit's (each is sent from its owner before the save).
#   pp_restart.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup pp_restart "$src"/docs/design.md "$src"/train/*.cpp
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/pp_debug.json")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.pp=2 --parallelism.tp=2 --parallelism.pp_microbatches=4 \
  --checkpoint.dir="$work/ck" --checkpoint.interval=10 --checkpoint.keep=0 \
  --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)
status=0
for layout in "1 --training.local_batch_size=1 --training.grad_accum_steps=4" \
  "4 --training.local_batch_size=1 --parallelism.pp=4 --parallelism.pp_schedule=interleaved_1f1b --parallelism.pp_microbatches=4" \
  "4 --training.local_batch_size=2 --parallelism.dp_shard=2 --parallelism.tp=2"; do
  resume_step11 "$work/ck" "$want" 1e-6 rel "pp2 x tp2" $layout || status=1
done
exit $status
