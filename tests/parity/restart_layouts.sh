#!/bin/bash
# A checkpoint taken under FSDP 4 resumes under FSDP 2, DDP 2 and one process (same global batch
# of 4 samples) with the same next-step loss as the uninterrupted FSDP 4 run, to the last digit.
#   restart_layouts.sh LOOM MPIEXEC SOURCE_DIR
set -euo pipefail
loom=$1 mpiexec=$2 src=$3
source "$(dirname "$0")/setup.sh"
parity_setup restart "$src"/docs/design.md "$src"/train/*.cpp
common=(--config "$src/configs/debug.toml" --data.path="$work/data")
"${mpi[@]}" -np 4 "$loom" train "${common[@]}" --training.steps=12 --training.local_batch_size=1 \
  --parallelism.dp_shard=4 --checkpoint.dir="$work/ck" --checkpoint.interval=10 \
  --checkpoint.keep=0 --metrics.jsonl="$work/full.jsonl" >"$work/full.log" 2>&1 || { cat "$work/full.log"; exit 1; }
rm -rf "$work/ck/step-00000012"
want=$(grep '"step": 11,' "$work/full.jsonl" | grep -o '"loss": [0-9.e-]*')
status=0
for layout in "2 --parallelism.dp_shard=2 --training.local_batch_size=2" \
  "2 --parallelism.dp_replicate=2 --parallelism.dp_shard=1 --training.local_batch_size=2" \
  "1 --training.local_batch_size=4"; do
  set -- $layout
  np=$1
  shift
  rm -rf "$work/ck2" "$work/res.jsonl"
  cp -r "$work/ck" "$work/ck2"
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" --training.steps=11 --checkpoint.dir="$work/ck2" \
    --checkpoint.resume=true --metrics.jsonl="$work/res.jsonl" "$@" >"$work/res.log" 2>&1 ||
    { cat "$work/res.log"; exit 1; }
  got=$(grep '"step": 11,' "$work/res.jsonl" | grep -o '"loss": [0-9.e-]*')
  echo "np $np $*: step 11 $got (uninterrupted FSDP 4: $want)"
  [ "$got" = "$want" ] || status=1
done
exit $status
