#!/bin/bash
# A GLA checkpoint taken under FSDP 2 x TP 2 (sequence parallel) holds global tensors with fla's
# names: it resumes under one process, CP 2 x FSDP 2 and TP 2 without SP (same global batch) with
# the next-step loss of the uninterrupted run within 5e-5 relative (the layouts sum in other
# orders, so not to the last digit), which needs every rank's shard and tp slice read back into
# the right place.
#   gla_restart.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup gla_restart
common=(--config "$src/configs/debug.toml" --data.path="$work/data"
  --model.config="$src/tests/parity/gla_debug.json")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=2 \
  --parallelism.dp_shard=2 --parallelism.tp=2 --checkpoint.dir="$work/ck" \
  --checkpoint.interval=10 --checkpoint.keep=0 --metrics.jsonl="$work/full.jsonl" \
  >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(step_loss "$work/full.jsonl" 11)
status=0
for layout in "1 --training.local_batch_size=4" \
  "4 --parallelism.cp=2 --parallelism.dp_shard=2 --training.local_batch_size=2" \
  "2 --parallelism.tp=2 --parallelism.tp_sequence_parallel=false --training.local_batch_size=4"; do
  resume_step11 "$work/ck" "$want" 5e-5 rel "GLA FSDP 2 x TP 2" $layout || status=1
done
exit $status
