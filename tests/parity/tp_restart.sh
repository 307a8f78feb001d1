#!/bin/bash
# A checkpoint taken under TP 2 (sequence parallel) holds global tensors: it resumes under one
# process, TP 4 and FSDP 2 x TP 2 (same global batch) with the next-step loss of the
# uninterrupted TP 2 run within 5e-5 relative (TP sums in another order, so not to the last digit),
# which needs every rank's slices read back from the right rows and columns.
#   tp_restart.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup tp_restart
common=(--config "$src/configs/debug.toml" --data.path="$work/data" --training.local_batch_size=4
  --model.config="$src/tests/parity/tp_debug.json")
"${mpi[@]}" -np 2 "$loom" train "${common[@]}" --training.steps=12 --parallelism.tp=2 \
  --checkpoint.dir="$work/ck" --checkpoint.interval=10 --checkpoint.keep=0 \
  --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)
status=0
for layout in "1" "4 --parallelism.tp=4" "4 --parallelism.tp=2 --parallelism.dp_shard=2 --training.local_batch_size=2"; do
  resume_step11 "$work/ck" "$want" 5e-5 rel "TP 2" $layout || status=1
done
exit $status
